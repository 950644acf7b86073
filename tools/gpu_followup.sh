#!/usr/bin/env bash
# Follow-up of the first gpu_check run (2026-12-04): clean per-kernel times of ours-triton and fla with
# no CUDA chunked kernel in flight, the text of the Triton CompilationError seen under triton 3.6.0,
# and whether the sm_90a forward / dS pass finish alone on a tiny case (they did not within 70 s in
# gpu_check). Everything under $OUT as it goes.
export PYTHONUNBUFFERED=1 FLA_DISABLE_BACKEND_DISPATCH=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/tools:/tmp/site
rm -rf /tmp/b && cp -r . /tmp/b
(cd /tmp/b && GDN_PACKED_CUDA_ARCHS=90a timeout 90 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1; echo "build rc=$?" >> $OUT/build.log) &
timeout 40 python3 -m pytest -x -q -p no:cacheprovider -o addopts= tests/test_isolation.py -k test_chunk_gated_triton > $OUT/compile_err.txt 2>&1
echo "compile test rc=$?"; grep -n "Error\|error" $OUT/compile_err.txt | head -8
timeout 80 python3 tools/gpu_check.py case profile --providers ours-triton,fla --shapes 1x32768 --csv $OUT/kernels_anchor.csv
wait
tail -2 $OUT/build.log
cat > /tmp/probe.py <<'PY'
import sys, time, torch
sys.path.insert(0, "/tmp/b"); sys.path.insert(0, "/tmp/b/tools")
import gdn_packed, gpu_check
from gdn_packed import _cext
print("C", _cext.built(), _cext.cuda_available(), _cext.cuda_unavailable_reason(), flush=True)
dev = torch.device("cuda")
(q, k, v, g, beta, h0), cu, cu_pad, _ = gpu_check._packed_inputs(dev, torch.bfloat16, [64], [0], 1, 1, 128, 128, 0, False)
t = time.time()
if sys.argv[1] == "fwd":
    o, ht = gdn_packed.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend="cuda")
else:
    print(gpu_check._case_cuda_dstate(q, k, v, g, beta, cu, cu_pad), flush=True)
torch.cuda.synchronize()
print(sys.argv[1], "FINISHED in", round(time.time() - t, 2), "s", flush=True)
PY
for m in fwd dstate; do (cd /tmp/b && timeout 20 python3 /tmp/probe.py $m 2>&1 | tail -4; echo "probe $m rc=${PIPESTATUS[0]}"); done | tee $OUT/probe.txt
timeout 60 python3 tools/gpu_check.py case profile --providers ours-triton,fla --shapes 4x8192 --csv $OUT/kernels_4x8192.csv
