"""``compare_logprobs`` (the metric the RL loop logs), ``run_audit`` and the ``zmrl parity`` subcommand."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

import zmrl.parity as parity
from zmrl.parity import FEATURES, ParityReport, add_parity_subcommand, compare_logprobs, run_audit

from tests.device import TEST_DEVICE


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # see tests/bitwise/test_parity_suite.py: tiny ops, shared 2-core machine
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ----------------------------------------------------------------------------- compare_logprobs


def _lps(seed: int, lengths: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [-torch.rand(n, generator=g) * 5 for n in lengths]


def test_compare_equal():
    roll = _lps(0, [3, 5, 1])
    train = [x.clone().requires_grad_() for x in roll]  # autograd tensors are accepted as they are
    r = compare_logprobs(roll, train, scenario="unit")
    assert r.ok and r.tokens_compared == r.tokens_equal == 9 and r.num_sequences == 3
    assert r.bitwise_equal_frac == 1.0 and r.max_abs_dlogp == 0.0 and r.kl_k1 == 0.0 and r.kl_k3 == 0.0
    assert r.first_mismatch is None and r.sequences_mismatched == 0
    assert "PASS" in r.table() and "unit" in r.table()


def test_compare_one_ulp_and_kl_values():
    roll = _lps(1, [4, 6])
    train = [x.clone() for x in roll]
    train[1][2] = torch.nextafter(train[1][2], torch.tensor(0.0))  # one ulp
    train[0][1] = train[0][1] + 0.25
    r = compare_logprobs(roll, train)
    assert not r.ok and r.tokens_equal == 8 and r.tokens_compared == 10
    assert r.bitwise_equal_frac == pytest.approx(0.8) and r.first_mismatch == (0, 1) and r.sequences_mismatched == 2
    d = torch.cat(train).double() - torch.cat(roll).double()  # lp_train - lp_roll
    # k1/k3 are accumulated in float64 from the same differences: agreement to float64 rounding
    assert r.kl_k1 == pytest.approx(float((-d).mean()), rel=1e-12, abs=1e-15)
    assert r.kl_k3 == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-12, abs=1e-15)
    assert r.max_abs_dlogp == pytest.approx(0.25, rel=1e-6) and r.kl_k3 > 0
    assert "FAIL" in r.table() and "sequence 0, token 1" in r.table()


def test_compare_never_raises_on_structure_mismatch():
    roll = _lps(2, [3, 4, 2])
    train = [roll[0].clone(), roll[1][:2].clone()]  # sequence 1 short by 2, sequence 2 missing
    r = compare_logprobs(roll, train)
    assert r.tokens_compared == 9 and r.tokens_equal == 5 and r.length_mismatches == 2
    assert r.first_mismatch == (1, 2) and not r.ok and r.kl_k1 == 0.0  # paired tokens are all equal
    nan = compare_logprobs([torch.tensor([-1.0, -2.0])], [torch.tensor([-1.0, float("nan")])])
    assert not nan.ok and math.isnan(nan.max_abs_dlogp)
    inf = compare_logprobs([torch.tensor([-math.inf])], [torch.tensor([-math.inf])])
    assert inf.ok and inf.max_abs_dlogp == 0.0 and inf.kl_k3 == 0.0
    empty = compare_logprobs([], [])
    assert empty.tokens_compared == 0 and not empty.ok  # an audit that compared nothing proves nothing
    assert math.isnan(empty.bitwise_equal_frac)  # undefined, never "all equal"
    assert set(compare_logprobs(roll, roll).as_dict()) == {
        "parity/tokens_compared", "parity/sequences_compared", "parity/bitwise_equal_frac", "parity/max_abs_dlogp", "parity/kl_k1", "parity/kl_k3"}


# ----------------------------------------------------------------------------- run_audit


@pytest.mark.parametrize("seed, dtype, scenario, steps", [
    (0, "float32", "random", 1),  # one RL round: AdamW step, update_weights, generate again
    (1, "float32", "all", 0),  # every feature at once: staggered, chunked, preemption, prefix, long, fp8, fork
    (2, "bfloat16", "random", 0),
])
def test_run_audit_is_bitwise(seed, dtype, scenario, steps):
    r = run_audit(num_requests=4, seed=seed, dtype=dtype, scenario=scenario, steps=steps, device=TEST_DEVICE)
    assert isinstance(r, ParityReport)
    assert r.ok, r.table()
    assert r.bitwise_equal_frac == 1.0 and r.kl_k1 == 0.0 and r.kl_k3 == 0.0 and r.max_abs_dlogp == 0.0
    assert r.num_sequences >= 4 * (steps + 1) and r.tokens_compared >= 4 * 4 * (steps + 1)
    assert f"seed {seed}" in r.scenario and dtype in r.scenario
    assert r.details["weights version"] == steps
    if scenario == "all":
        assert r.details["latent format"] == "fp8" and r.details["prefix cache hits"] > 0


def test_run_audit_scenarios_are_seeded():
    import random

    drawn = {parity._parse_scenario("random", random.Random(s)) for s in range(20)}
    assert len(drawn) > 5 and all(d and set(d) <= set(FEATURES) for d in drawn)
    assert parity._parse_scenario("fp8,chunked", random.Random(0)) == ("chunked", "fp8")
    with pytest.raises(ValueError, match="unknown scenario"):
        parity._parse_scenario("warp", random.Random(0))


# ----------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zmrl")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parity_subcommand(sub)
    return parser


def test_cli_pass_prints_table(capsys):
    args = _parser().parse_args(["parity", "--num-requests", "3", "--seed", "5", "--dtype", "float32",
                                 "--scenario", "chunked,long", "--steps", "0", "--device", str(TEST_DEVICE)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for row in ("tokens compared", "bitwise equal", "(1.000000)", "max |dlogp|", "kl k1", "kl k3", "PASS"):
        assert row in out, out


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["parity", "--scenario", "warp"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["parity", "--dtype", "float16"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["parity", "--num-requests", "0"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["parity", "--kernel-mode", "turbo"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["parity", "--device", "tpu"])


def test_cli_mismatch_exits_1(monkeypatch, capsys):
    real = parity.trainer_logprobs

    def off_by_one_ulp(*args, **kwargs):
        lps = [lp.detach().clone() for lp in real(*args, **kwargs)]
        lps[0][0] = torch.nextafter(lps[0][0], torch.zeros((), device=lps[0].device))
        return lps

    monkeypatch.setattr(parity, "trainer_logprobs", off_by_one_ulp)
    r = run_audit(num_requests=2, seed=3, scenario="basic", steps=0, device=TEST_DEVICE)
    assert not r.ok and r.bitwise_equal_frac < 1.0 and r.first_mismatch == (0, 0)
    assert r.tokens_equal == r.tokens_compared - 1 and r.max_abs_dlogp > 0
    args = _parser().parse_args(["parity", "--num-requests", "2", "--seed", "3", "--scenario", "basic", "--steps", "0",
                                 "--device", str(TEST_DEVICE)])
    assert args.func(args) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "(1.000000)" not in out and "first mismatch" in out
