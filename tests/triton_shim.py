"""Make the Triton interpreter (TRITON_INTERPRET=1) behave like compiled Triton for the kernels we test.

Imported by tests/conftest.py before any kernel runs, and only when the interpreter is on. It fixes
three gaps between the interpreter (triton 3.6-3.9) and a GPU, and one bug of triton 3.6's interpreter (0.):
  1. bf16 values are kept as raw uint16 and arithmetic, tl.dot, reductions and scans run on the bit
     patterns, and fp32 -> bf16 casts truncate (the GPU rounds to nearest even). Here every bf16
     operation is computed in float32 and rounded back to bf16 to nearest even, which is what the
     hardware does for bf16 math and casts; tl.dot takes exact fp32 products.
  2. `range()` loop variables are Python ints, where compiled Triton makes them tensors (FLA's kernels
     call `i_t.to(tl.int64)`); the loop body now rebinds them as tensors.
  3. `@triton.autotune` with several configs benchmarks them through the (absent) GPU driver; only the
     first config survives pruning, so nothing is benchmarked.
Our own kernels need only (1) for tl.dot on bf16 operands; fla-core (the test oracle) needs all three.
"""
import ast

import numpy as np
import triton.language as tl
import triton.runtime.autotuner as autotuner
import triton.runtime.interpreter as interp

_Builder = interp.InterpreterBuilder
_Handle = interp.TensorHandle


# -- 0. triton <= 3.6: a scalar loaded from memory as an index ------------------------------------------
def _install_scalar_index():
    """triton 3.6's interpreter makes `tensor.__index__` int(data), which numpy >= 2 refuses for the
    one-element rank-1 array a scalar load gives (`range(c1 - c0)` fails); later versions squeeze first."""
    patch_tensor = interp._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).squeeze()))

    interp._patch_lang_tensor = patched


# -- 3. autotune: keep one config ----------------------------------------------------------------------
def _install_single_config():
    prune = autotuner.Autotuner.prune_configs

    def first_config_only(self, kwargs, *args, **kw):
        return prune(self, kwargs, *args, **kw)[:1]

    autotuner.Autotuner.prune_configs = first_config_only
    # triton 3.6 still "benchmarks" a single surviving config (through the absent driver): time none
    if hasattr(autotuner.Autotuner, "_bench"):
        autotuner.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]


# -- 2. loop induction variables as tensors -------------------------------------------------------------
class _TensorLoopVars(interp.ASTTransformer):
    """`for i in range(...)` / `tl.range(...)`: prepend `i = interpreter_semantic.to_tensor(i, False)`."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        call = node.iter
        if isinstance(call, ast.Call) and isinstance(node.target, ast.Name):
            f = call.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if fname == "range":
                to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                          attr="to_tensor", ctx=ast.Load())
                rebind = ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                                    value=ast.Call(func=to_tensor,
                                                   args=[ast.Name(id=node.target.id, ctx=ast.Load()),
                                                         ast.Constant(value=False)], keywords=[]))
                node.body.insert(0, ast.fix_missing_locations(ast.copy_location(rebind, node)))
        return node


# -- 1. bf16 computed in fp32 ------------------------------------------------------------------------------
def _bf16(handle):
    return handle.dtype.scalar == tl.bfloat16


def _widen(data):
    """uint16 bf16 bit patterns -> float32 values."""
    return (np.asarray(data).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _narrow(x):
    """float32 values -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _as_f32(handle):
    return _widen(handle.data) if _bf16(handle) else handle.data


def _install_bf16_math():
    binary, unary, dot = _Builder.binary_op, _Builder.unary_op, _Builder.create_dot

    def binary_op(self, lhs, rhs, op):
        if not (_bf16(lhs) or _bf16(rhs)):
            return binary(self, lhs, rhs, op)
        out = op(_as_f32(lhs), _as_f32(rhs))
        if out.dtype == np.bool_:
            return _Handle(out, tl.int1)
        return _Handle(_narrow(out), tl.bfloat16)

    def unary_op(self, arg, op):
        if not _bf16(arg):
            return unary(self, arg, op)
        return _Handle(_narrow(op(_widen(arg.data))), tl.bfloat16)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if _bf16(a) or _bf16(b):
            a, b = _Handle(_as_f32(a), tl.float32), _Handle(_as_f32(b), tl.float32)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    _Builder.binary_op, _Builder.unary_op, _Builder.create_dot = binary_op, unary_op, create_dot

    cast, fp_to_fp = _Builder.cast_impl, _Builder.create_fp_to_fp

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
            return _Handle(_narrow(src.data), tl.bfloat16)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
            return _Handle(_narrow(src.data), tl.bfloat16)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    _Builder.cast_impl, _Builder.create_fp_to_fp = cast_impl, create_fp_to_fp
    for name in ("create_fp_trunc", "create_fp_ext"):
        setattr(_Builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    if not hasattr(_Builder, "get_bf16"):      # triton <= 3.8: bf16 scalar constants
        _Builder.get_bf16 = lambda self, value: self.cast_impl(self.get_fp32(value), tl.bfloat16)

    # reductions and scans: run on fp32 copies, round the result back to bf16
    def in_f32(t):
        ty = t.type.with_element_ty(tl.float32) if t.type.is_block() else tl.float32
        return tl.core.tensor(_Handle(_widen(t.handle.data), tl.float32), ty)

    def back(self, r):
        data = _narrow(r.handle.data)
        return self.to_tensor(data if r.type.is_block() else data.reshape(()), tl.bfloat16)

    R, S = interp.ReduceOps, interp.ScanOps
    red_sum, red_minmax, scan_sum, scan_prod = R.sum, R.min_max, S.cumsum, S.cumprod

    def sum_(self, x):
        return back(self, red_sum(self, in_f32(x))) if x.dtype == tl.bfloat16 else red_sum(self, x)

    def min_max(self, x, val_reduce_op, idx_reduce_op=None):
        x0 = x[0] if isinstance(x, tuple) else x
        if x0.dtype != tl.bfloat16:
            return red_minmax(self, x, val_reduce_op, idx_reduce_op)
        r = red_minmax(self, in_f32(x0), val_reduce_op, idx_reduce_op)
        if isinstance(r, tuple):
            return (back(self, r[0]) if val_reduce_op else r[0]), r[1]
        return back(self, r) if val_reduce_op else r

    def scan(orig):
        def f(self, x):
            if x.dtype != tl.bfloat16:
                return orig(self, x)
            return [back(self, y) for y in orig(self, in_f32(x))]
        return f

    R.sum, R.min_max, S.cumsum, S.cumprod = sum_, min_max, scan(scan_sum), scan(scan_prod)


_install_scalar_index()
_install_single_config()
interp.FunctionRewriter.ast_transformer = _TensorLoopVars()
_install_bf16_math()
