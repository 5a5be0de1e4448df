"""Chapter 19's experiment: a character-level GPT on real text, optimizers compared by steps to a target.

The model is :class:`optbook.models.TinyTransformer` (pre-norm, GELU MLP, learned positions) over the
62 characters of :mod:`optbook.text`'s public-domain corpus; every run samples its training windows
from the fixed training split with its own seed and measures the held-out loss (nats per character)
on fixed windows of the validation split (:func:`optbook.text.eval_batches`).

Optimizers, as in chapter 18b: ``"AdamW"`` updates every tensor; ``"Muon"``, ``"NorMuon"`` and ``"Dion"``
update the hidden matrices (:func:`optbook.optim.muon_param_groups`) and hand the embeddings, the output
head and the norm gains to AdamW at the same learning rate, chained into one
:class:`optbook.optim.ChainedOptimizer`. Muon and NorMuon use the RMS-matched scale
``0.2 * sqrt(max(A, B))`` (Moonlight, arXiv:2502.16982, §2.2) so that a learning rate means what AdamW's
does; Dion keeps a quarter of the rank (Ahn et al., arXiv:2504.05295). No warmup, schedule or decay.

The comparison rule is 18b's: a one-sided Mann-Whitney U test of steps (or seconds) to the target,
each optimizer against AdamW, at level ``0.01`` Bonferroni-corrected over the comparisons. Seconds to
the target are steps times the optimizer's cost of a step, measured with the optimizers taking turns
(:func:`step_seconds`), so that a machine whose speed changes over the runs slows all of them alike.
``tools/capstone.py`` (``make capstone``) runs the full table; the chapter runs a smaller one.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from . import text
from ._checks import check_int
from .models import TinyTransformer
from .optim import AdamW, ChainedOptimizer, Dion, Muon, NorMuon, muon_param_groups
from .qk_clip import qk_clip_

__all__ = ["OPTIMIZERS", "Setup", "Run", "new_model", "build_optimizer", "held_out_loss", "steps_to_target",
           "step_seconds", "compare", "max_logit_run"]

OPTIMIZERS = ("AdamW", "Muon", "NorMuon", "Dion")


@dataclass(frozen=True)
class Setup:
    """One experiment's shape. ``target`` is a held-out loss in nats per character; a run that has not
    reached it after ``max_steps`` steps counts as ``inf`` steps (checked every ``eval_every`` steps on
    ``eval_windows`` validation windows of ``seq_len`` characters)."""

    d_model: int = 48
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    batch_size: int = 16
    max_steps: int = 250
    eval_every: int = 10
    eval_windows: int = 64
    target: float = 2.25

    def __post_init__(self):
        for name in ("d_model", "n_layers", "n_heads", "seq_len", "batch_size", "max_steps", "eval_every",
                     "eval_windows"):
            check_int(name, getattr(self, name), 1)
        if not self.target > 0:
            raise ValueError(f"Invalid target: expected a loss > 0, got {self.target!r}")


@dataclass
class Run:
    """One training run: ``steps`` to the target (``math.inf`` if never), ``seconds`` of training up to
    then (evaluation excluded; ``inf`` if never), and the ``curve`` of ``(step, held-out loss)``."""

    steps: float
    seconds: float
    curve: list = field(default_factory=list)


def new_model(setup: Setup, seed: int, vocab_size: int, device=None) -> TinyTransformer:
    """The model for ``seed`` (its initialisation is seeded with ``seed``), float32 on ``device``."""
    torch.manual_seed(seed)
    return TinyTransformer(vocab_size, d_model=setup.d_model, n_layers=setup.n_layers, n_heads=setup.n_heads,
                           max_seq_len=setup.seq_len).to(device)


def build_optimizer(name: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) for ``model`` at learning rate ``lr``.

    Raises:
        ValueError: unknown ``name`` or ``lr <= 0``.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"Invalid name: expected one of {OPTIMIZERS}, got {name!r}")
    if not lr > 0:
        raise ValueError(f"Invalid lr: expected > 0, got {lr!r}")

    def adamw(params):
        return AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    if name == "AdamW":
        return adamw(model.parameters())
    r = muon_param_groups(model)
    rms = dict(scale_mode="spectral", extra_scale_factor=0.2, ns_dtype=torch.float32)  # RMS-matched, fp32 NS
    matrix = {"Muon": lambda g: Muon(g, lr=lr, **rms),
              "NorMuon": lambda g: NorMuon(g, lr=lr, **rms),
              "Dion": lambda g: Dion(g, lr=lr, rank_fraction=0.25)}[name]
    return ChainedOptimizer([matrix(r.muon), adamw(r.adamw)])


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean cross-entropy (nats per character) of ``model`` on ``x``, ``y`` int64 ``(n, T)``, in eval mode."""
    was_training = model.training
    model.eval()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    model.train(was_training)
    return loss


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def steps_to_target(name: str, lr: float, seed: int, setup: Setup, split: text.TextSplit | None = None,
                    device=None, *, stop_at_target: bool = True) -> Run:
    """Train optimizer ``name`` at ``lr`` from seed ``seed`` until the held-out loss reaches ``setup.target``.

    ``seed`` fixes the initialisation and the stream of training windows (shared by every optimizer).
    With ``stop_at_target=False`` the run goes on to ``max_steps`` (for a full loss curve).
    """
    split = text.load_corpus() if split is None else split
    device = torch.device("cpu") if device is None else torch.device(device)
    model = new_model(setup, seed, split.tokenizer.vocab_size, device)
    opt = build_optimizer(name, model, lr)
    x_val, y_val = (t.to(device) for t in text.eval_batches(split.val, setup.seq_len, setup.eval_windows))
    gen = torch.Generator().manual_seed(seed)
    run, seconds = Run(math.inf, math.inf), 0.0
    for step in range(1, setup.max_steps + 1):
        x, y = (t.to(device) for t in text.sample_batch(split.train, setup.batch_size, setup.seq_len, gen))
        _sync(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        _sync(device)
        seconds += time.perf_counter() - start
        if step % setup.eval_every == 0:
            loss = held_out_loss(model, x_val, y_val)
            run.curve.append((step, loss))
            if not math.isfinite(loss):
                break
            if loss <= setup.target and math.isinf(run.steps):
                run.steps, run.seconds = step, seconds
                if stop_at_target:
                    break
    return run


def step_seconds(lrs: dict[str, float], setup: Setup, split: text.TextSplit | None = None, device=None, *,
                 rounds: int = 7, steps_per_round: int = 5, warmup: int = 3) -> dict[str, float]:
    """Median seconds of one training step (forward, backward, ``step()``) per optimizer in ``lrs``.

    The optimizers take turns: ``rounds`` rounds of ``steps_per_round`` steps each, one optimizer after the
    other in every round, after ``warmup`` untimed steps each, so that all of them see the same machine
    (a busy or throttling machine slows them alike). Returns ``{name: median over rounds of the mean step
    time}`` in seconds.
    """
    check_int("rounds", rounds, 1)
    check_int("steps_per_round", steps_per_round, 1)
    split = text.load_corpus() if split is None else split
    device = torch.device("cpu") if device is None else torch.device(device)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, lr in lrs.items():
        model = new_model(setup, 0, split.tokenizer.vocab_size, device)
        state[name] = (model, build_optimizer(name, model, lr))
    batches = [text.sample_batch(split.train, setup.batch_size, setup.seq_len, gen)
               for _ in range(steps_per_round)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]

    def steps(name, n):
        model, opt = state[name]
        for x, y in batches[:n]:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()

    times = {name: [] for name in lrs}
    for name in lrs:
        for _ in range(warmup):
            steps(name, 1)
    for _ in range(rounds):
        for name in lrs:
            _sync(device)
            start = time.perf_counter()
            steps(name, steps_per_round)
            _sync(device)
            times[name].append((time.perf_counter() - start) / steps_per_round)
    return {name: statistics.median(ts) for name, ts in times.items()}


def compare(values: dict[str, list[float]], reference: str = "AdamW", alpha: float = 0.01) -> dict[str, dict]:
    """18b's rule: for each optimizer other than ``reference``, one-sided Mann-Whitney U tests of
    ``values[name]`` (steps or seconds, ``inf`` for never) against ``values[reference]``, at level
    ``alpha / (number of comparisons)``.

    Returns ``{name: {"median" (the middle value, the mean of the two middle ones for an even count),
    "ratio" (reference median / this median; 0 when this median is inf), "p_faster", "p_slower",
    "verdict"}}``; the reference's row has ``verdict == "reference"`` and no p-values.
    """
    import scipy.stats

    level = alpha / max(1, len(values) - 1)
    base = values[reference]
    out = {}
    for name, xs in values.items():
        med = float(statistics.median(xs))
        ratio = statistics.median(base) / med if math.isfinite(med) else 0.0
        row = {"median": med, "ratio": float(ratio)}
        if name == reference:
            out[name] = row | {"p_faster": None, "p_slower": None, "verdict": "reference"}
            continue
        pf = float(scipy.stats.mannwhitneyu(xs, base, alternative="less").pvalue)
        ps = float(scipy.stats.mannwhitneyu(xs, base, alternative="greater").pvalue)
        verdict = "faster" if pf < level else "slower" if ps < level else "no difference shown"
        out[name] = row | {"p_faster": pf, "p_slower": ps, "verdict": verdict}
    return out


def max_logit_run(lr: float, seed: int, setup: Setup, steps: int, tau: float | None = None,
                  split: text.TextSplit | None = None) -> dict:
    """Muon (+AdamW) at ``lr`` for ``steps`` steps on the corpus, recording the largest attention logit.

    With ``tau``, :func:`optbook.qk_clip_` runs after every step (MuonClip, Kimi K2 arXiv:2507.20534 §2.1).
    Returns ``{"max_logit": [steps floats, the max over layers and heads of S_max at each step, before
    any clip], "loss": the held-out loss at the end, "setup": asdict(setup)}``.
    """
    check_int("steps", steps, 1)
    split = text.load_corpus() if split is None else split
    model = new_model(setup, seed, split.tokenizer.vocab_size)
    opt = build_optimizer("Muon", model, lr)
    gen = torch.Generator().manual_seed(seed)
    record = []
    for _ in range(steps):
        x, y = text.sample_batch(split.train, setup.batch_size, setup.seq_len, gen)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        record.append(float(model.max_logits().max()))
        if tau is None:
            model.reset_max_logits()
        else:
            qk_clip_(model, tau)
    x_val, y_val = text.eval_batches(split.val, setup.seq_len, setup.eval_windows)
    return {"max_logit": record, "loss": held_out_loss(model, x_val, y_val), "setup": asdict(setup)}
