import torch

import zmrl.parity.smoke as smoke


def test_smoke_passes():
    r = smoke.run_smoke(num_prompts=2, max_new_tokens=3)
    assert r.ok and r.tokens_compared == 6 and r.max_abs_diff == 0.0


def test_smoke_reports_a_mismatch(monkeypatch):
    real = smoke.compute_logprobs

    def off_by_one_ulp(*args, **kwargs):
        out = real(*args, **kwargs)
        out[0] = torch.nextafter(out[0], torch.full_like(out[0], -float("inf")))
        return out

    monkeypatch.setattr(smoke, "compute_logprobs", off_by_one_ulp)
    r = smoke.run_smoke(num_prompts=2, max_new_tokens=3)
    assert not r.ok and r.tokens_equal == 3 and r.max_abs_diff > 0
