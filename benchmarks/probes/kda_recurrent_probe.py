"""Probe: KDA forwards over whole sequences, token-recurrent vs chunked, zmrl (both ``Numerics.kda_form``s) and
fla-core (``fused_recurrent_kda``, ``chunk_kda``), H = 16, dk = dv = 128; the last shape is a decode step's
(one token of each of 256 sequences). Writes $OUT/kda_recurrent_probe.json (a GPU is required)."""
import json
import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from kda_vs_fla import make_inputs, time_ms
from fla.ops.kda import chunk_kda, fused_recurrent_kda
from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.kda import kda_chunk
from zmrl.kernels_batch_invariant.triton import triton_impl

zm = triton_impl(kda_chunk)
rows = []
for t, n in [(16384, 4), (8192, 1), (32768, 4), (32768, 1), (256, 256)]:
    x = make_inputs(t, n)
    cu = x["cu"].cuda()
    args = [x[k][None] for k in ("q", "k", "v", "g", "beta")]
    row = {"T": t, "seqs": n}
    with torch.no_grad():
        row["fla_recurrent_ms"] = time_ms(lambda: fused_recurrent_kda(*args, output_final_state=True, cu_seqlens=cu))
        row["fla_chunk_ms"] = time_ms(lambda: chunk_kda(*args, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=x["cu"]))
        outs = {}
        for form in ("chunk", "recurrent"):
            with numerics_scope(current_numerics().replace(kda_form=form)):
                row[f"zmrl_{form}_ms"] = time_ms(lambda: zm(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"]))
                outs[form] = zm(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"])[0].float()
        o_r = fused_recurrent_kda(*args, output_final_state=True, cu_seqlens=cu)[0][0].float()
        ref = outs["chunk"]
        row["max_rel_diff_fla_recurrent_vs_zmrl_chunk"] = ((o_r - ref).abs().max() / ref.abs().max()).item()
        row["max_rel_diff_zmrl_recurrent_vs_chunk"] = ((outs["recurrent"] - ref).abs().max() / ref.abs().max()).item()
    print(json.dumps(row), flush=True)
    rows.append(row)
Path(os.environ.get("OUT", "."), "kda_recurrent_probe.json").write_text(json.dumps(rows, indent=1))
