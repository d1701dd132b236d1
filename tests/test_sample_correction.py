"""The log-q correction of Partial FC's sampled softmax (``head.sample_correction``): each
class's odds of being in a step's sample, checked against sampling many times, and the
corrected loss against the sampled softmax computed by hand."""

import pytest
import torch

from embedtrain.heads.sharded import PartialFCHead
from embedtrain.heads.sample import partial_fc_sample, sample_log_q

C, D = 400, 8


def _frequencies(seed=0):
    """A Zipf-like label distribution over ``C`` classes (every class has some mass)."""
    ranks = torch.randperm(C, generator=torch.Generator().manual_seed(seed)).double() + 1
    p = ranks ** -1.1
    return p / p.sum()


@pytest.mark.parametrize("rate, labels", [(0.1, 30), (0.05, 200)],
                         ids=["negatives-drawn", "positives-fill-the-sample"])
def test_log_q_is_the_odds_of_being_in_the_sample(rate, labels):
    """Over 4,000 steps with labels drawn from the frequencies, how often each class of a
    rank's slice ``[100, 400)`` was in Partial FC's sample matches the mean of ``exp(log q)``."""
    freq = _frequencies()
    start, end = 100, C
    slice_freq = freq[start:end] / freq.sum()
    g = torch.Generator().manual_seed(1)
    trials, hits, expected = 4_000, torch.zeros(end - start), torch.zeros(end - start)
    every = torch.arange(end - start)
    for _ in range(trials):
        targets = torch.multinomial(freq, labels, replacement=True, generator=g)
        targets = torch.cat([targets, torch.full((5,), -1)])  # padding is no label
        hits[partial_fc_sample(targets, start, end, rate, g)] += 1
        expected += sample_log_q(every, targets, start, end, rate, slice_freq).exp()
    observed, expected = hits / trials, expected / trials
    # within 4 binomial standard errors (and 0.01 for the positives' iid approximation)
    se = (expected * (1 - expected) / trials).sqrt()
    assert bool(((observed - expected).abs() <= 4 * se + 0.01).all()), (
        (observed - expected).abs().max())
    assert float(expected.max() / expected.min()) > 3  # frequent classes in far more often


def test_the_corrected_loss_is_the_sampled_softmax_minus_log_q():
    freq = _frequencies(2)
    counts = (freq * 10_000).round()
    g = torch.Generator().manual_seed(3)
    features = torch.randn(12, D, generator=g)
    labels = torch.multinomial(freq, 12, replacement=True, generator=g)
    heads = {}
    for corrected in (False, True):
        head = PartialFCHead(C, D, sample_rate=0.2, seed=5,
                             class_counts=counts if corrected else None)
        heads[corrected] = (head, head(features, labels), head.last_sample)
    (head, loss, sample), (_, plain, plain_sample) = heads[True], heads[False]
    assert torch.equal(sample, plain_sample)  # the correction does not change the sample
    log_q = sample_log_q(sample, labels, 0, C, 0.2, counts.double() / counts.sum())
    logits = features @ head.weight.detach()[sample].t() - log_q
    cols = torch.searchsorted(sample, labels)
    ref = torch.nn.functional.cross_entropy(logits, cols)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    assert abs(float(loss) - float(plain)) > 1e-3


def test_at_rate_one_the_correction_is_nothing():
    """Every class is in every step's sample: ``q = 1`` and the loss is the exact softmax's."""
    counts = (_frequencies() * 10_000).round()
    features = torch.randn(6, D, generator=torch.Generator().manual_seed(4))
    labels = torch.tensor([0, 5, 17, 17, 399, 250])
    out = [PartialFCHead(C, D, sample_rate=1.0, seed=5, class_counts=c)(features, labels)
           for c in (None, counts)]
    assert torch.equal(out[0], out[1])


def test_correction_needs_partial_fc_with_softmax():
    from embedtrain.models.options import HeadKind, HeadLoss
    from embedtrain.heads.build import build_head

    for kind, loss in ((HeadKind.FULL, HeadLoss.SOFTMAX), (HeadKind.PARTIAL_FC, HeadLoss.BCE)):
        with pytest.raises(ValueError, match="sample_correction: needs kind partial_fc with "
                                             "loss softmax"):
            build_head(kind, C, D, loss=loss, sample_correction=True)
