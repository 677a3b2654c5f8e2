"""Generation (megatron_kappa/evaluation/generation.py; issue 35): the key/value-cache path gives the
tokens of recomputing the whole sequence at every step (the reference), κ and the nanochat block
included; the sampling filters keep exactly the tokens a naive top-k / nucleus rule keeps.
Negative control: a cache whose position is not advanced gives other tokens."""
import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.evaluation.generation import Sampling, generate, next_token
from megatron_kappa.model.build import build_model
from tests.support.settings import MLA  # the tiny MLA settings


def model_of(*sets):
    """A tiny model whose every parameter is drawn here from one seed (not from megatron's RNG
    state, which earlier tests in the process move): matrices at 1.5/√fan-in, κ's α and b at N(0, 1),
    gains and λ near 1."""
    cfg = load_config("configs/tiny.yaml", ["model.seq_length=48", "model.kappa.freeze_fraction=0", *sets])
    model = build_model(cfg, "cpu").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            draw = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name.endswith(("kappa_alpha", "kappa_bias")):
                p.copy_(draw)
            elif p.dim() >= 2:
                p.copy_(draw * 1.5 / p.shape[-1] ** 0.5)
            else:
                p.copy_(1 + 0.2 * draw)
    return model, cfg


def recomputed(model, prompt, n, vocab):
    """Greedy tokens, the whole sequence run again for each one (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids])
            ids.append(int(model(x, torch.arange(len(ids))[None], None)[0, -1, :vocab].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("sets", [[], ["model.block=nanochat", "model.moe.router=sigmoid"], MLA],
                         ids=["kappa", "nanochat", "mla"])
def test_the_cache_gives_the_tokens_of_recomputing_everything(world1, sets, monkeypatch):
    model, cfg = model_of(*sets)
    prompt = torch.randint(0, cfg.model.vocab_size, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    want = recomputed(model, prompt, 10, cfg.model.vocab_size)
    assert len(set(want)) > 1  # not one token repeated
    assert generate(model, prompt, 10, cfg.model.vocab_size) == want
    # stops at `stop` (included) and at max_length positions
    assert generate(model, prompt, 10, cfg.model.vocab_size, stop=want[3]) == want[:want.index(want[3]) + 1]
    assert generate(model, prompt, 10, cfg.model.vocab_size, max_length=len(prompt) + 4) == want[:4]
    # negative control: every step written at the prompt's end (the position never advances):
    # the steps' logits (recorded as the sampler sees them) change
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_kappa.evaluation import generation
    seen, sample = [], generation.next_token
    monkeypatch.setattr(generation, "next_token", lambda logits, *a: seen.append(logits.clone()) or sample(logits, *a))
    generate(model, prompt, 10, cfg.model.vocab_size)
    good, seen[:] = list(seen), []
    monkeypatch.setattr(StaticInferenceContext, "sequence_len_offset",
                        property(lambda self: 7 if getattr(self, "_started", False) else 0,
                                 lambda self, value: setattr(self, "_started", value > 0)), raising=False)
    generate(model, prompt, 10, cfg.model.vocab_size)
    assert max((a - b).abs().max().item() for a, b in zip(good[2:], seen[2:])) > 1e-3


def naive_allowed(logits, top_k, top_p):
    """The tokens sampling may pick: the k best (ties kept), then the fewest best whose
    probability reaches top_p."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    keep = [i for i in order if top_k == 0 or logits[i] >= logits[order[top_k - 1]]]
    probs = torch.tensor([logits[i] for i in keep]).softmax(0).tolist()
    allowed, mass = [], 0.0
    for i, p in zip(keep, probs):
        if mass >= top_p:
            break
        allowed.append(i)
        mass += p
    return set(allowed)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.6), (4, 0.8), (1, 1.0)])
def test_sampling_draws_only_and_all_of_what_the_filters_keep(top_k, top_p):
    logits = torch.tensor([[2.0, 0.5, 1.5, -1.0, 1.0, 0.0, 1.2, -0.5]])
    allowed = naive_allowed(logits[0].tolist(), top_k, top_p)
    sampling = Sampling(temperature=1.0, top_k=top_k, top_p=top_p)
    gen = torch.Generator().manual_seed(0)
    drawn = {int(next_token(logits, sampling, gen)) for _ in range(400)}
    assert drawn == allowed
    assert int(next_token(logits, Sampling(), None)) == 0  # greedy: the best


def test_bad_sampling_settings_are_one_line_errors():
    for bad, key in ((Sampling(temperature=-1), "--temperature"), (Sampling(temperature=1, top_k=-2), "--top-k"),
                     (Sampling(temperature=1, top_p=0), "--top-p")):
        with pytest.raises(ValueError, match=key):
            bad.check()
