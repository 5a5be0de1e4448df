"""optbook.kernels: the symmetric Gram kernels, run by Triton's interpreter on CPU tensors.

``TRITON_INTERPRET=1`` is set per test (a fixture, so no other test file sees it): ``optbook.kernels`` reads
it on each call and jits its kernel for the interpreter, so the kernel a GPU compiles runs in numpy here.
Small shapes and 16 x 16 tiles (``blocks=(16, 16)``) so that sizes cross tile edges; the interpreter is
slow (tenths of a second a call). One test compiles the kernel for a Hopper GPU, which needs none.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from optbook import newton_schulz  # noqa: E402
from optbook.bench import run_benchmark  # noqa: E402
from optbook.kernels import gram_backend, gram_poly, gram_xxt  # noqa: E402
from helpers import scaled_timeout  # noqa: E402

SMALL = (16, 16)
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _gram_bound(X, dtype):
    """Elementwise error bound of a float32-accumulated X X^T rounded once to ``dtype``.

    Accumulating ``n`` products in float32 errs by at most ``n u32 (|X| |X|^T)`` (Higham 2002, sec. 3.1,
    u32 = eps/2); the final rounding to bf16/fp16 adds ``u (|X X^T|) <= u (|X| |X|^T)``. We allow
    ``n eps32 + eps(dtype)`` times ``|X| |X|^T``: twice the worst case, and still far below what a wrong
    tile or a dropped 16-wide k-chunk gives (about 16 / n of ``|X| |X|^T``: 0.25 for n = 65, against
    8e-6 allowed in float32 and 8e-3 in bf16).
    """
    n = X.shape[-1]
    absprod = X.double().abs() @ X.double().abs().mT
    tol = n * EPS32 + (torch.finfo(dtype).eps if dtype != torch.float32 else 0.0)
    return tol * absprod + 1e-30


CASES = [((1, 1), torch.float32), ((5, 7), torch.float32), ((33, 65), torch.float32),
         ((65, 33), torch.float32), ((3, 17, 40), torch.float32),
         ((5, 7), torch.bfloat16), ((33, 65), torch.bfloat16), ((3, 17, 40), torch.bfloat16),
         ((33, 65), torch.float16), ((3, 17, 40), torch.float16)]


def _case_id(value):
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value).removeprefix("torch.")


@pytest.mark.parametrize("shape, dtype", CASES, ids=_case_id)
def test_gram_equals_the_float64_product_and_is_exactly_symmetric(interpret, shape, dtype):
    # reference: X @ X^T in float64 of the same (already rounded) inputs; tolerance from _gram_bound
    X = torch.randn(*shape).to(dtype)
    A = gram_xxt(X, blocks=SMALL)
    assert A.shape == (*shape[:-1], shape[-2]) and A.dtype == dtype
    ref = X.double() @ X.double().mT
    assert ((A.double() - ref).abs() <= _gram_bound(X, dtype)).all()
    assert torch.equal(A, A.mT)  # bit for bit: each element is written once, its mirror from the same value


def test_bf16_gram_is_within_one_rounding_of_torchs_bf16_product(interpret):
    # reference: torch's bf16 X @ X.mT (float32 accumulation, one rounding); two roundings of nearly the same
    # float32 number differ by at most one bf16 ulp of the value, 2^-7 relative
    X = torch.randn(3, 17, 40).bfloat16()
    A, ref = gram_xxt(X, blocks=SMALL).double(), (X @ X.mT).double()
    assert ((A - ref).abs() <= 2 ** -7 * ref.abs() + 1e-6).all()


@pytest.mark.parametrize("dtype, high", [(torch.bfloat16, 4), (torch.float16, 16)])
def test_exact_products_round_to_nearest_even_like_torch(interpret, dtype, high):
    # integer entries: every product and sum is exact in float32 (|sums| < 2^24), so the only rounding is
    # the final one to dtype, which must be torch's (round to nearest, ties to even) bit for bit; the sums
    # need more significand bits than bf16's 8 / fp16's 11, so ties and round-ups occur
    X = torch.randint(-high, high + 1, (3, 17, 40)).to(dtype)
    exact = X.float() @ X.float().mT
    assert torch.equal(gram_xxt(X, blocks=SMALL), exact.to(dtype))
    assert (exact.to(dtype).float() != exact).any()   # the test does exercise the rounding


@pytest.mark.parametrize("view", ["transposed", "strided slice", "expanded batch"])
def test_non_contiguous_input_needs_no_copy(interpret, view):
    base = torch.randn(3, 40, 35)
    X = {"transposed": base.mT,                              # (3, 35, 40), column-major matrices
         "strided slice": base[:, ::2, 1::2],                # (3, 20, 17), strides (1400, 70, 2)
         "expanded batch": base[0].expand(4, 40, 35)}[view]  # batch stride 0
    A = gram_xxt(X, blocks=SMALL)
    ref = X.double() @ X.double().mT
    assert ((A.double() - ref).abs() <= _gram_bound(X, torch.float32)).all() and torch.equal(A, A.mT)


def test_many_tiles_map_to_every_lower_tile_once(interpret):
    # 200 rows in 16-row tiles: 13 tile rows, 91 lower tiles, each program's (i, j) from inverting
    # pid = i (i + 1) / 2 + j with a float32 sqrt. (That sqrt is exact at these sizes; the kernel's two
    # integer fix-ups are for grids of millions of tiles, beyond what the interpreter can run.)
    X = torch.randn(200, 3)
    A = gram_xxt(X, blocks=SMALL)
    assert ((A.double() - X.double() @ X.double().mT).abs() <= _gram_bound(X, torch.float32)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(33, 33), (2, 17, 17)])
def test_fused_second_line_equals_bA_plus_cA2_and_is_exactly_symmetric(interpret, shape, dtype):
    # reference: b A + c A^2 in float64 of the same symmetric A; one float32 accumulation of m products
    # plus one rounding to dtype, so the bound of _gram_bound on |c| |A| |A| + |b| |A|
    b, c = -4.7750, 2.0315
    A = gram_xxt(torch.randn(*shape[:-1], 24).to(dtype), blocks=SMALL) / 24
    B = gram_poly(A, b, c, blocks=SMALL)
    A64 = A.double()
    ref = b * A64 + c * A64 @ A64
    m = shape[-1]
    tol = (m * EPS32 + (torch.finfo(dtype).eps if dtype != torch.float32 else EPS32)) * (
        abs(c) * A64.abs() @ A64.abs() + abs(b) * A64.abs())
    assert ((B.double() - ref).abs() <= tol).all() and torch.equal(B, B.mT)


def test_out_is_written_and_returned(interpret):
    X = torch.randn(2, 9, 20)
    out = torch.full((2, 9, 9), float("nan"))
    assert gram_xxt(X, out=out, blocks=SMALL) is out and torch.equal(out, out.mT)
    B = torch.empty(9, 9)
    assert gram_poly(out[0], 0.5, 1.0, out=B) is B and not B.isnan().any() and torch.equal(B, B.mT)


def test_backend_is_the_interpreter_with_the_variable_and_torch_without(interpret, monkeypatch):
    X = torch.randn(5, 7)
    assert gram_backend(X) == "triton-interpreter"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert gram_backend(X) == "torch"   # a CPU tensor: the documented fallback, torch's own product
    assert torch.equal(gram_xxt(X), X @ X.mT)
    A = X @ X.mT
    assert torch.equal(gram_poly(A, 2.0, 3.0), torch.addmm(A, A, A.mT, beta=2.0, alpha=3.0))
    A = torch.randn(2, 40, 40).bfloat16()
    assert torch.equal(gram_poly(A, 2.0, 0.0), 2.0 * A)   # c = 0 (the cubic's step): b A


@pytest.mark.parametrize("call, error, match", [
    (lambda: gram_xxt(torch.randn(4)), ValueError, "Invalid X: expected a 2-D"),
    (lambda: gram_xxt(torch.randn(2, 2, 3, 4)), ValueError, "Invalid X: expected a 2-D"),
    (lambda: gram_xxt(torch.randn(3, 0)), ValueError, "Invalid X: expected every size"),
    (lambda: gram_xxt(torch.randn(3, 4).double()), TypeError, "Invalid X: expected dtype"),
    (lambda: gram_xxt(torch.ones(3, 4, dtype=torch.int32)), TypeError, "Invalid X: expected dtype"),
    (lambda: gram_xxt([[1.0]]), TypeError, "Invalid X: expected a torch.Tensor"),
    (lambda: gram_xxt(torch.randn(3, 4), out=torch.empty(4, 4)), ValueError, "Invalid out: expected shape"),
    (lambda: gram_xxt(torch.randn(3, 4), out=torch.empty(3, 3).bfloat16()), ValueError, "Invalid out"),
    (lambda: gram_xxt(torch.randn(3, 4), out=torch.empty(3, 6)[:, ::2]), ValueError, "Invalid out: .*contig"),
    (lambda: gram_xxt(torch.randn(3, 4), blocks=(16, 24)), ValueError, "Invalid blocks"),
    (lambda: gram_xxt(torch.randn(3, 4), blocks=(8, 16)), ValueError, "Invalid blocks"),
    (lambda: gram_xxt(torch.randn(3, 4, requires_grad=True)), ValueError, "Invalid X: it requires grad"),
    (lambda: gram_poly(torch.randn(3, 4), 1.0, 1.0), ValueError, "Invalid A: expected square"),
    (lambda: gram_poly(torch.randn(3, 3), float("nan"), 1.0), ValueError, "Invalid b"),
    (lambda: gram_poly(torch.randn(3, 3), 1.0, torch.tensor(1.0)), TypeError, "Invalid c"),
])
def test_bad_input_raises_naming_the_argument(interpret, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_out_sharing_the_inputs_memory_is_refused(interpret):
    A = torch.randn(4, 4)
    A = A + A.T
    with pytest.raises(ValueError, match="Invalid out: it shares memory"):
        gram_poly(A, 1.0, 1.0, out=A)


@pytest.mark.parametrize("shape, coefficients", [((2, 16, 24), "simple"), ((24, 16), "polar_express"),
                                                 ((20, 20), "cubic")])
def test_symmetric_newton_schulz_equals_the_plain_one(interpret, shape, coefficients):
    # reference: newton_schulz(gram="plain"), torch's bmm path. Both accumulate in float32 and round each
    # product once to bf16, in different summation orders; measured here over 8 seeds: identical for simple
    # and cubic, 3e-5 apart for polar_express. Tolerance 2 bf16 ulps of 1 (2^-6), room for a flipped rounding
    # that a few steps amplify, far below the O(1) error of a wrong tile
    G = torch.randn(*shape)
    plain = newton_schulz(G, coefficients=coefficients)
    symmetric = newton_schulz(G, coefficients=coefficients, gram="symmetric")
    assert symmetric.shape == G.shape and symmetric.dtype == G.dtype
    torch.testing.assert_close(symmetric, plain, rtol=0, atol=2 ** -6)
    # float32 iteration: the two paths agree to float32 accumulation error
    symmetric32 = newton_schulz(G, coefficients=coefficients, dtype=torch.float32, gram="symmetric")
    plain32 = newton_schulz(G, coefficients=coefficients, dtype=torch.float32)
    torch.testing.assert_close(symmetric32, plain32, rtol=0, atol=1e-5)


def test_newton_schulz_refuses_an_unknown_gram_or_a_dtype_the_kernel_lacks():
    G = torch.randn(4, 6)
    with pytest.raises(ValueError, match="Invalid gram"):
        newton_schulz(G, gram="triangular")
    with pytest.raises(ValueError, match="Invalid gram"):
        newton_schulz(G, dtype=torch.float64, gram="symmetric")
    with pytest.raises(ValueError, match="Invalid gram: 'symmetric' has no backward"):
        newton_schulz(G.requires_grad_(), gram="symmetric")
    with torch.no_grad():   # how an optimizer step calls it
        assert newton_schulz(G, gram="symmetric").shape == G.shape


def test_benchmark_times_the_symmetric_gram_step_and_newton_schulz(interpret):
    rows = run_benchmark([(16, 24)], ["bfloat16", "float64"], batch=1, steps=1, repeat=1, paths=["symmetric"])
    # the kernel has no float64: only the matmul reference is measured for it
    assert [(r["dtype"], r["path"]) for r in rows] == [("bfloat16", "matmul"), ("bfloat16", "gram_symmetric"),
                                                       ("bfloat16", "symmetric"), ("float64", "matmul")]
    gram = rows[1]
    assert gram["flops"] == rows[0]["flops"] == 2 * 16 * 16 * 24   # credited the full product
    assert gram["fraction_of_matmul"] == pytest.approx(rows[0]["seconds"] / gram["seconds"])
    assert rows[2]["orthogonality_error"] is not None


@pytest.mark.parametrize("dtype, epilogue", [("bf16", True), ("fp32", False)])
def test_the_kernel_compiles_for_a_hopper_gpu_without_one(dtype, epilogue, monkeypatch):
    # the GPU path, which CI cannot run: Triton compiles the same kernel for sm_90 (H100/H200) down to
    # PTX and a cubin with the ptxas of its wheel, no device needed. Arguments specialised as a launch on
    # 16-aligned contiguous tensors would be (unit inner strides, divisibility by 16)
    import triton
    from optbook.kernels import _triton_gram
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # so triton.jit gives a compilable kernel
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton has no ASTSource/GPUTarget")
    fn = triton.jit(_triton_gram._sym_gram_kernel)
    constexprs = dict(x_stride_c=1, a_stride_c=1, o_stride_c=1, BLOCK=128, BLOCK_K=64, EPILOGUE=epilogue,
                      INTERPRET=False, INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    signature = {name: "constexpr" if name in constexprs else f"*{dtype}" if name.endswith("_ptr")
                 else "fp32" if name.startswith("coef") else "i32" for name in fn.arg_names}
    aligned = [name for name, kind in signature.items() if kind != "constexpr" and not name.startswith("coef")
               and not name.endswith("_c")]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=8, num_stages=3, enable_fp_fusion=True))
    assert kernel.asm["cubin"]
    if dtype == "bf16":  # tensor cores (fp32 with "ieee" products runs on the fp32 units: no mma)
        assert "mma" in kernel.asm["ptx"]


#: Shared memory one block may use (opt-in), bytes: CUDA's per-compute-capability limits, what Triton compares
#: a kernel's need with before launching it (``OutOfResources`` above it). 7.5 T4, 8.0 A100, 8.6 RTX 30xx/A10,
#: 9.0 H100/H200, 12.0 RTX 50xx (8.9, RTX 40xx/L4, has 8.6's limit and compiles as 8.6 does here).
SHARED_MEMORY_LIMIT = {75: 65536, 80: 166912, 86: 101376, 90: 232448, 120: 101376}


@pytest.mark.parametrize("capability", sorted(SHARED_MEMORY_LIMIT))
def test_default_tiles_fit_the_shared_memory_of_each_gpu_generation(capability, monkeypatch):
    # float32 128 x 64 tiles, pipelined, needed 128 KiB: on an RTX 3090/4090/5090, A10 or L4 (99 KiB a block)
    # every float32 Gram product with more than 1024 rows (python -m optbook.bench's defaults) raised
    # OutOfResources at its first launch. Compiled here as a launch on 16-aligned tensors would compile it.
    import triton
    from optbook.kernels import _triton_gram
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton has no ASTSource/GPUTarget")
    fn = triton.jit(_triton_gram._sym_gram_kernel)
    limit = SHARED_MEMORY_LIMIT[capability]
    for dtype, torch_dtype, M in (("fp32", torch.float32, 1024), ("fp32", torch.float32, 4096),
                                  ("bf16", torch.bfloat16, 4096)):
        BLOCK, BLOCK_K = _triton_gram._default_blocks(M, 4 * M, False, torch_dtype)
        constexprs = dict(x_stride_c=1, a_stride_c=1, o_stride_c=1, BLOCK=BLOCK, BLOCK_K=BLOCK_K, EPILOGUE=True,
                          INTERPRET=False, INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32")
        signature = {name: "constexpr" if name in constexprs else f"*{dtype}" if name.endswith("_ptr")
                     else "fp32" if name.startswith("coef") else "i32" for name in fn.arg_names}
        aligned = [name for name, kind in signature.items() if kind != "constexpr"
                   and not name.startswith("coef") and not name.endswith("_c")]
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", capability, 32),
                                options=_triton_gram._launch_options(BLOCK, False))
        shared = kernel.metadata.shared
        assert shared <= limit, \
            f"sm_{capability} {dtype} M={M} tiles {(BLOCK, BLOCK_K)}: {shared} bytes of shared memory"


def test_importing_the_kernels_module_does_not_import_triton():
    # triton (hundreds of MB, a compiler) loads on the first kernel launch only; optbook.kernels is lazy too
    code = ("import sys, optbook, optbook.kernels, torch; "
            "optbook.newton_schulz(torch.randn(4, 6)); "
            "assert 'triton' not in sys.modules; "
            "assert optbook.kernels.gram_backend(torch.ones(1, 1)) == 'torch'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=scaled_timeout(120))
    assert done.returncode == 0, done.stderr


def test_muon_passes_gram_to_newton_schulz_and_symmetric_steps_like_plain(interpret, monkeypatch):
    # reference: Muon(gram="plain"), torch's bmm path; the same tolerance reasoning as the symmetric-vs-
    # plain newton_schulz test above (both round each bf16 product once, in different orders), for 3 steps
    # of lr 0.02
    from optbook.optim import Muon
    muon_module = sys.modules["optbook.optim.muon"]   # the module (optbook.optim.functional.muon is the function)
    seen = []
    real = muon_module.newton_schulz
    monkeypatch.setattr(muon_module, "newton_schulz", lambda *a, **k: seen.append(k["gram"]) or real(*a, **k))
    W = [torch.randn(24, 16), torch.randn(24, 16), torch.randn(16, 40)]
    plain = [w.clone().requires_grad_() for w in W]
    symmetric = [w.clone().requires_grad_() for w in W]
    opts = Muon(plain, lr=0.02), Muon(symmetric, lr=0.02, gram="symmetric")
    assert opts[0].param_groups[0]["gram"] == "plain"   # the default is unchanged
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = [torch.randn(w.shape, generator=g) for w in W]
        for opt, ps in zip(opts, (plain, symmetric)):
            for p, grad in zip(ps, grads):
                p.grad = grad.clone()
            opt.step()
    assert seen == ["plain", "plain", "symmetric", "symmetric"] * 3   # two shapes per step, one batched
    for a, b, w in zip(plain, symmetric, W):
        assert float((a - w).detach().abs().max()) > 0.01   # both moved
        torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=0.02 * 2 ** -6 * 3)


def test_muon_refuses_an_unknown_gram_or_symmetric_float64_before_any_write():
    from optbook.optim import Muon
    with pytest.raises(ValueError, match="Invalid gram"):
        Muon([torch.randn(4, 6, requires_grad=True)], gram="triangular")
    with pytest.raises(ValueError, match="Invalid gram: 'symmetric' needs ns_dtype"):
        Muon([torch.randn(4, 6, requires_grad=True)], gram="symmetric", ns_dtype=torch.float64)
    W = torch.randn(4, 6, requires_grad=True)
    opt = Muon([W], ns_dtype=torch.float64)
    W.grad = torch.randn(4, 6)
    opt.step()
    before, buf = W.detach().clone(), opt.state[W]["momentum_buffer"].clone()
    opt.param_groups[0]["gram"] = "symmetric"   # an edit is checked at step(), before anything is written
    with pytest.raises(ValueError, match="Invalid gram"):
        opt.step()
    assert torch.equal(W.detach(), before) and torch.equal(opt.state[W]["momentum_buffer"], buf)
