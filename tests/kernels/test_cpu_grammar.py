"""The grammar-mask CPU kernels (kernels/cpu_grammar.py): the in-place mask equals torch's and
xgrammar's, the fused greedy scan equals argmax of the masked row (ties, NaN and +inf at allowed
and masked positions, vocabularies that are not a multiple of 32, masks narrower than the
logits), on the AVX2 and the scalar code, and a masked token is never chosen."""

import pytest
import torch

from pagedserve.kernels import cpu_grammar

pytestmark = pytest.mark.skipif(not cpu_grammar.available(),
                                reason="grammar-mask kernels unavailable here")
xgr = pytest.importorskip("xgrammar")


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """[R, V] bool -> [R, ceil(V / 32)] int32 bitmask (xgrammar's layout)."""
    r, v = allowed.shape
    w = (v + 31) // 32
    bits = torch.zeros(r, w * 32, dtype=torch.bool)
    bits[:, :v] = allowed
    words = torch.zeros(r, w, dtype=torch.int64)
    for b in range(32):
        words |= bits[:, b::32].long() << b
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # bit 31 wraps as in int32


def reference_argmax(logits: torch.Tensor, allowed: torch.Tensor) -> list[int]:
    """argmax of each masked row; a row whose allowed logits are all -inf: its first allowed
    token; a row that allows nothing: 0."""
    out = []
    for x, ok in zip(logits, allowed):
        if not ok.any():
            out.append(0)
            continue
        masked = x.masked_fill(~ok, float("-inf"))
        t = int(masked.argmax())
        out.append(t if ok[t] else int(ok.nonzero()[0]))
    return out


def random_case(gen, rows, vocab, density):
    logits = torch.randn(rows, vocab, generator=gen) * 4
    allowed = torch.rand(rows, vocab, generator=gen) < density
    return logits, allowed


@pytest.mark.parametrize("vocab", [32, 77, 1000, 4096 + 5])
@pytest.mark.parametrize("density", [0.0, 0.002, 0.3, 0.97, 1.0])
def test_apply_masks_the_given_rows_only_as_xgrammar(vocab, density):
    gen = torch.Generator().manual_seed(vocab)
    logits, allowed = random_case(gen, 5, vocab, density)
    rows = [3, 0, 4]
    mask = pack(allowed[rows])
    ours = logits.clone()
    assert cpu_grammar.apply_token_bitmask(ours, mask, rows)
    ref = logits.clone()
    ref[rows] = ref[rows].masked_fill(~allowed[rows], float("-inf"))
    assert torch.equal(ours, ref)  # (rows 1 and 2 untouched)
    if vocab % 32 == 0:  # NOTE: xgrammar 0.2.9 writes into the next row otherwise
        full = torch.full((5, mask.shape[1]), -1, dtype=torch.int32)
        full[rows] = mask
        xg = logits.clone()
        xgr.apply_token_bitmask_inplace(xg, full, vocab_size=vocab, indices=rows)
        assert torch.equal(ours, xg)


def test_apply_masks_the_padding_past_the_mask_width():
    logits = torch.zeros(1, 100)
    mask = pack(torch.ones(1, 64, dtype=torch.bool))  # covers 64 of 100 tokens
    assert cpu_grammar.apply_token_bitmask(logits, mask, [0])
    assert torch.isfinite(logits[0, :64]).all() and (logits[0, 64:] == float("-inf")).all()


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("vocab", [31, 32, 100, 2048, 4096 + 17])
def test_masked_argmax_equals_argmax_of_the_masked_row(scalar, vocab):
    gen = torch.Generator().manual_seed(vocab + scalar)
    for density in (0.001, 0.05, 0.5, 0.99, 1.0):
        logits, allowed = random_case(gen, 6, vocab, density)
        allowed[0] = False  # nothing allowed
        logits[1] = logits[1].round()  # many ties: the first maximum wins
        got = cpu_grammar.masked_argmax(logits, pack(allowed), list(range(6)), scalar=scalar)
        assert got.tolist() == reference_argmax(logits, allowed)


@pytest.mark.parametrize("scalar", [False, True])
def test_masked_argmax_specials_at_masked_and_allowed_positions(scalar):
    v = 200
    nan, inf = float("nan"), float("inf")
    logits = torch.zeros(7, v)
    allowed = torch.zeros(7, v, dtype=torch.bool)
    allowed[:, [5, 40, 41, 150, 199]] = True
    logits[:, 41] = 2.0
    logits[0, [3, 64, 100]] = nan  # NaN only where masked: never chosen
    logits[1, [3, 64]] = inf  # +inf only where masked
    logits[2, [64, 150]] = nan  # an allowed NaN counts as the maximum (the first one)
    logits[2, 3] = nan
    logits[3, [150, 199]] = inf  # allowed +inf: the first
    logits[4] = float("-inf")  # every allowed logit -inf: the first allowed token
    logits[4, 0] = 7.0  # (masked)
    logits[5, [40, 41, 199]] = 2.0  # ties among allowed, a larger masked value before them
    logits[5, 1] = 9.0
    logits[6] = float("-inf")
    logits[6, 199] = -1e30  # the last word, partial
    got = cpu_grammar.masked_argmax(logits, pack(allowed), list(range(7)), scalar=scalar)
    assert got.tolist() == [41, 41, 150, 150, 5, 40, 199]
    assert all(allowed[i, t] for i, t in enumerate(got.tolist()))


def test_masked_argmax_takes_rows_and_never_writes_the_logits():
    gen = torch.Generator().manual_seed(1)
    logits, allowed = random_case(gen, 4, 512, 0.1)
    before = logits.clone()
    rows = [2, 0]
    got = cpu_grammar.masked_argmax(logits, pack(allowed[rows]), rows)
    assert got.tolist() == reference_argmax(logits[rows], allowed[rows])
    assert torch.equal(logits, before)


def test_what_does_not_apply_returns_none_or_false():
    mask = pack(torch.ones(1, 64, dtype=torch.bool))
    assert cpu_grammar.masked_argmax(torch.zeros(1, 64, dtype=torch.float64), mask, [0]) is None
    assert cpu_grammar.masked_argmax(torch.zeros(1, 64), mask.long(), [0]) is None
    assert cpu_grammar.masked_argmax(torch.zeros(1, 64), mask, [0, 0]) is None  # one row per mask
    assert not cpu_grammar.apply_token_bitmask(torch.zeros(64, 2).t(), mask, [0])  # strided rows
