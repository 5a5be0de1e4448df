"""The shared helpers: digits split, generated quadratics, models and the training loop."""

import pytest
import torch

from optbook.data import associative_recall, copy_task, ill_conditioned_quadratic, load_digits
from optbook.models import MLP, LogisticRegression
from optbook.optim import AdamW
from optbook.runtime import seed_everything
from optbook.training import evaluate, train


def test_digits_split_is_deterministic_stratified_and_standardised():
    a, b = load_digits(), load_digits()
    assert a.X_train.shape == (1347, 64) and a.X_test.shape == (450, 64)
    assert torch.equal(a.X_train, b.X_train) and torch.equal(a.y_test, b.y_test)
    assert torch.bincount(a.y_test).min() >= 43  # stratified: 25% of each class (the smallest has 174)
    assert a.X_train.mean(0).abs().max() < 1e-5
    std = a.X_train.std(0, unbiased=False)
    assert torch.allclose(std[std > 0], torch.ones_like(std[std > 0]), atol=1e-4)
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(1.5)


def test_quadratic_has_the_requested_spectrum_and_minimiser():
    q = ill_conditioned_quadratic(dim=8, condition_number=1e3, seed=3)
    assert q.condition_number == pytest.approx(1e3)
    assert torch.allclose(torch.linalg.eigvalsh(q.A), q.eigenvalues, atol=1e-12)
    assert float(q.loss(q.x_star)) == 0.0
    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    q.loss(x).backward()
    assert torch.allclose(x.grad, q.grad(x.detach()), atol=1e-12)
    with pytest.raises(ValueError, match="condition_number"):
        ill_conditioned_quadratic(condition_number=0.5)


def test_models_have_the_documented_shapes():
    assert LogisticRegression(64, 10)(torch.zeros(5, 64)).shape == (5, 10)
    mlp = MLP(64, 32, 10, depth=3, norm=True)
    assert mlp(torch.zeros(5, 64)).shape == (5, 10)
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in mlp) == 3
    with pytest.raises(ValueError, match="depth"):
        MLP(4, 4, 2, depth=0)


def test_training_loop_learns_digits_and_records_update_rms():
    seed_everything(0)
    data = load_digits()
    model = MLP(64, 32, 10)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    log = train(model, opt, data.X_train, data.y_train, steps=150, batch_size=64, record_update_rms=True)
    assert len(log.losses) == 150 and log.losses[-1] < 0.3 * log.losses[0]
    assert log.update_rms.shape == (150, len(list(model.parameters())))
    # Adam's first step is lr * sign(g) on every element with a non-zero gradient: RMS close to 1
    assert 0.9 < float(log.update_rms[0, 0]) <= 1.0 + 1e-6
    loss, acc = evaluate(model, data.X_test, data.y_test)
    assert acc > 0.9
    with pytest.raises(ValueError, match="steps"):
        train(model, opt, data.X_train, data.y_train, steps=0)


def test_seed_everything_rejects_bad_input():
    with pytest.raises(ValueError, match="seed"):
        seed_everything(-1)


def test_train_copy_task_is_repeatable_clips_and_rejects_bad_input():
    from optbook.training import train_copy_task

    for bad, match in (({"optimizer": "SGD"}, "optimizer"), ({"tau": 0.0}, "tau"), ({"tau": float("nan")}, "tau"),
                       ({"steps": 0}, "steps")):
        kwargs = {"optimizer": "Muon", **bad}
        with pytest.raises(ValueError, match=match):
            train_copy_task(kwargs.pop("optimizer"), 0, torch.Generator().manual_seed(1), **kwargs)
    runs = [train_copy_task("Muon", 0, torch.Generator().manual_seed(1), steps=3, tau=1e-3,
                            record=lambda m: m.layers[0].attn.q_proj.weight.detach().clone()) for _ in range(2)]
    (model, log), (model2, log2) = runs
    assert len(log.losses) == 3 and log.max_logits.shape == (3, 2, 4) and log.losses == log2.losses
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    report, w = log.extras[-1]
    assert len(report) == 8 and torch.equal(w, model.layers[0].attn.q_proj.weight)  # tau = 1e-3 clips every head
    _, adamw_log = train_copy_task("AdamW", 0, torch.Generator().manual_seed(1), steps=2, n_kv_heads=2)
    assert adamw_log.extras == [(None, None), (None, None)]


@pytest.mark.parametrize("task, args, error, name", [
    (copy_task, (2, 8.0, 10), TypeError, "seq_len"), (copy_task, (2, 8, 10.0), TypeError, "vocab_size"),
    (copy_task, (True, 8, 10), TypeError, "batch_size"), (copy_task, (0, 8, 10), ValueError, "batch_size"),
    (copy_task, (2, 7, 10), ValueError, "seq_len"), (copy_task, (2, 8, 1), ValueError, "vocab_size"),
    (associative_recall, (2, 3.0, 10), TypeError, "n_pairs"), (associative_recall, (0, 3, 10), ValueError, "batch_size"),
    (associative_recall, (2, 3, 3), ValueError, "vocab_size"), (associative_recall, (2, 6, 10), ValueError, "n_pairs")])
def test_sequence_tasks_name_a_bad_argument(task, args, error, name):
    with pytest.raises(error, match=f"Invalid {name}"):
        task(*args)
    good = copy_task(2, 8, 10) if task is copy_task else associative_recall(2, 3, 10)
    assert good[0].dtype == torch.int64 and good[0].shape == good[1].shape
