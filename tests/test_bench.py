"""optbook.bench: the Newton–Schulz FLOP model against counted FLOPs, the overhead model, the CLI."""

import json
import runpy
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from optbook import newton_schulz
from optbook.bench import (main, ns_flops, ns_overhead, orthogonality_error, run_benchmark,
                           transformer_muon_shapes)


def test_one_step_costs_two_gram_sized_products_and_one_cube():
    # m <= n: A = X X^T 2 m^2 n, A^2 2 m^3, B X 2 m^2 n (a multiply-add is 2 FLOPs)
    m, n = 6, 10
    assert ns_flops((m, n), steps=1) == 2 * m * m * n + 2 * m ** 3 + 2 * m * m * n == 1872
    assert ns_flops((n, m), steps=1) == 1872  # a tall matrix is transposed first: Gram of min(m, n)
    assert ns_flops((3, 2, m, n), steps=5) == 6 * 5 * 1872


@pytest.mark.parametrize("shape, steps, coefficients, dtype", [
    ((6, 10), 5, "simple", torch.float32), ((10, 6), 5, "simple", torch.bfloat16),
    ((3, 8, 8), 5, "quintic", torch.float32), ((2, 12, 5), 5, "polar_express", torch.float16),
    ((7, 9), 10, "deepseek_v4", torch.float64), ((2, 7, 9), 4, "cubic", torch.bfloat16),  # c = 0: no A^2
])
def test_the_model_equals_the_flops_torch_counts_in_the_real_call(shape, steps, coefficients, dtype):
    # reference: torch.utils.flop_counter.FlopCounterMode over newton_schulz itself (it counts mm/bmm/baddbmm
    # by shape, 2 FLOPs per multiply-add, nothing else): the model must match exactly
    G = torch.randn(*shape)
    with FlopCounterMode(display=False) as counter:
        newton_schulz(G, steps=steps, coefficients=coefficients, dtype=dtype)
    assert counter.get_total_flops() == ns_flops(shape, steps, coefficients)


def test_transformer_muon_matrices_hold_twelve_width_squared_per_layer():
    shapes = transformer_muon_shapes(64, 3)
    assert len(shapes) == 6 * 3 and sum(m * n for m, n in shapes) == 12 * 64 ** 2 * 3


def test_overhead_is_about_four_times_dp_width_over_batch_tokens():
    # 5 simple steps per layer: 4 x 6 d^3 (attention) + 2 x 18 d^3 (MLP) = 60 d^3 per step, 300 d^3 per call;
    # 6 N T = 72 d^2 L T, so ratio = dp * 300 d / (72 T) = 25 dp d / (6 T), whatever the depth
    for width, depth, tokens, dp in [(1024, 4, 2 ** 19, 1), (4096, 32, 2 ** 22, 8), (768, 12, 2 ** 16, 64)]:
        got = ns_overhead(width, depth, tokens, dp)
        assert got.ratio == pytest.approx(25 * dp * width / (6 * tokens), rel=1e-12)
        assert got.train_flops == 6 * 12 * width ** 2 * depth * tokens
        sharded = ns_overhead(width, depth, tokens, dp, sharded=True)
        assert sharded.ratio == pytest.approx(got.ratio / dp, rel=1e-12)
    # an output head in N lowers the ratio and brings depth in
    head = ns_overhead(1024, 4, 2 ** 19, vocab_size=50304)
    assert head.params == 12 * 1024 ** 2 * 4 + 50304 * 1024
    assert head.ratio < ns_overhead(1024, 4, 2 ** 19).ratio
    # the "< 1%" regime and its failure: sharded 4096-wide at 4M tokens vs replicated over 64 ranks at 1M
    assert ns_overhead(4096, 32, 2 ** 22, 64, sharded=True).ratio < 0.01
    assert ns_overhead(4096, 32, 2 ** 20, 64).ratio > 0.5


@pytest.mark.parametrize("call, word", [
    (lambda: ns_flops((5,)), "shape"), (lambda: ns_flops((0, 4)), "shape"),
    (lambda: ns_flops((4, 4), 0), "steps"),
    (lambda: ns_flops((4, 4), coefficients="sextic"), "coefficients"),
    (lambda: ns_overhead(0, 2, 10), "width"),
    (lambda: ns_overhead(8, 2, 0), "batch_tokens"), (lambda: ns_overhead(8, 2, 10, dp=0), "dp"),
    (lambda: ns_overhead(8, 2, 10, vocab_size=-1), "vocab_size"),
    (lambda: run_benchmark([(4, 4)], ["float8"]), "dtypes"),
    (lambda: run_benchmark([(4, 4)], ["float32"], 0), "batch"),
    (lambda: run_benchmark([(4, 4)], ["float32"], paths=["triangular"]), "paths"),
    (lambda: run_benchmark([(4, 4)], ["float32"], paths=[]), "paths"),
    (lambda: orthogonality_error(torch.ones(3)), "O"),
])
def test_bad_arguments_raise_naming_the_argument(call, word):
    with pytest.raises(ValueError, match=word):
        call()


def test_a_size_that_is_not_an_int_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="depth"):
        ns_overhead(8, 2.0, 10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(4, 24, 40), (3, 40, 24), (2, 3, 33, 65)])
def test_batched_call_equals_the_loop_over_its_matrices(shape, dtype):
    # Muon orthogonalises same-shape matrices in one call on their stack (one bmm per product); each
    # matrix of the batch must get what a call on it alone gives. Bitwise equal on the CPUs tried
    # (torch 2.13); the tolerance, 8 ulps of 1 in the iteration dtype, leaves room for kernels that
    # split a batch differently from a single matrix (other rounding orders, compounded over 5 steps).
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    batched = newton_schulz(G, coefficients="polar_express", dtype=dtype)
    loop = torch.stack([newton_schulz(g, coefficients="polar_express", dtype=dtype)
                        for g in G.reshape(-1, *shape[-2:])]).reshape(shape)
    torch.testing.assert_close(batched, loop, rtol=0, atol=8 * torch.finfo(dtype).eps)


def test_orthogonality_error_is_the_largest_distance_of_a_squared_singular_value_from_one():
    g = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(8, 4, generator=g, dtype=torch.float64))[0]
    O = U @ torch.diag(torch.tensor([1.0, 1.0, 0.9, 1.1], dtype=torch.float64)) @ V.T  # 4 x 8
    assert orthogonality_error(O) == pytest.approx(0.21, abs=1e-12)  # |1.1^2 - 1| > |0.9^2 - 1| = 0.19
    assert orthogonality_error(torch.stack([O.T, V @ U.T])) == pytest.approx(0.21, abs=1e-12)  # tall, batched
    lost = torch.cat([U @ V.T, torch.zeros(1, 8, dtype=torch.float64)])  # a row with no direction: |0 - 1|
    assert orthogonality_error(lost) == pytest.approx(1.0, abs=1e-12)


def test_cli_smoke_run_writes_its_json_report(tmp_path, monkeypatch, capsys):
    path = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--shapes", "16x32,24x8", "--dtypes", "float32,bfloat16", "--batch", "2",
            "--repeat", "1", "--json", str(path)]
    monkeypatch.setattr(sys, "argv", ["optbook.bench", *argv])
    monkeypatch.delitem(sys.modules, "optbook.bench")  # run it fresh as __main__, as `-m` does
    runpy.run_module("optbook.bench", run_name="__main__")  # what `python -m optbook.bench` runs
    report = json.loads(path.read_text())
    rows = report["results"]
    assert {(tuple(r["shape"]), r["dtype"], r["path"]) for r in rows} == {
        (s, d, p) for s in [(16, 32), (24, 8)] for d in ["float32", "bfloat16"]
        for p in ["matmul", "plain", "batched"]}
    for r in rows:
        assert r["seconds"] > 0 and r["tflops"] > 0 and r["fraction_of_matmul"] > 0
        if r["path"] != "matmul":
            assert r["flops"] == ns_flops((2, *r["shape"]))
        if r["path"] == "batched":  # 5 simple steps: singular values in about [0.68, 1.13], so < 0.6
            assert 0 < r["orthogonality_error"] < 0.7
    assert report["device_type"] == "cpu" and "TFLOP/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv, word", [
    (["--shapes", "16by32"], "--shapes"), (["--dtypes", "float8"], "--dtypes"),
    (["--device", "tpu9"], "--device"),
    (["--batch", "0"], "--batch"), (["--coefficients", "sextic"], "coefficients"),
    (["--paths", "plain,triangular"], "--paths"),
])
def test_cli_refuses_bad_options_naming_the_option(argv, word, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert word in capsys.readouterr().err
