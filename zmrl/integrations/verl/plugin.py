"""The ``verl.plugins`` entry point: verl imports this module (it does not call anything), so importing it
registers zmrl with verl."""
from . import register

register()
