export PYTHONPATH=$PWD/src:$PWD/tests/gpu PYTHONUNBUFFERED=1 PTXFORGE_CACHE_DIR=/tmp/ptxforge-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -q | grep -iE 'compute mode|mig mode|product name' | head -4
which nvidia-cuda-mps-control
echo "## E5 two streams"
timeout 60 python -c "
import torch, time; torch.cuda._sleep(1); torch.cuda.synchronize(); s = [torch.cuda.Stream() for _ in range(2)]; t = time.time()
for st in s:
    with torch.cuda.stream(st): torch.cuda._sleep(int(4e9))
torch.cuda.synchronize(); print('two 4e9-cycle sleeps on two streams: %.2f s' % (time.time() - t))"
cat > /tmp/e2.py <<'PY'
import multiprocessing as mp, time
def spin(q):
    import torch; torch.cuda._sleep(1); torch.cuda.synchronize(); q.put(1); t = time.time()
    torch.cuda._sleep(int(1.5e10)); torch.cuda.synchronize(); print('A: spin kernel %.2f s' % (time.time() - t), flush=True)
def probe(q):
    import torch; x = torch.zeros(1, device='cuda'); torch.cuda.synchronize(); q.get(); time.sleep(1)
    for i in range(5):
        t = time.time(); x += 1; torch.cuda.synchronize(); print('B: tiny kernel while A spins %.4f s' % (time.time() - t), flush=True); time.sleep(0.3)
if __name__ == '__main__':
    c = mp.get_context('spawn'); q = c.Queue(); ps = [c.Process(target=f, args=(q,)) for f in (spin, probe)]
    [p.start() for p in ps]; [p.join(60) for p in ps]
PY
echo "## E2 time slice (no MPS)"; timeout 80 python /tmp/e2.py
echo "## E4 cold JIT"
PTXFORGE_CACHE_DIR=$(mktemp -d) timeout 120 python -c "
import time; from ptxforge import jit; from ptxforge.ops._common import device_arch
from ptxforge.kernels.ep_intranode import dispatch as d, combine as c; a = device_arch(0)
for h, sms, fp8, wt in [(256, 4, False, True), (7168, 20, True, True)]:
    t = time.time(); jit.build(d.generate(d.choose_config(a, 2, h, 8, fp8=fp8, with_topk=wt, num_sms=sms, slots=64))).launcher(0); print('dispatch h%d %.2f s' % (h, time.time() - t))
t = time.time(); jit.build(c.generate(c.choose_config(a, 2, 7168, topk=8, num_sms=20, slots=64))).launcher(0); print('combine %.2f s' % (time.time() - t))"
echo "## MPS"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
if nvidia-cuda-mps-control -d; then
  echo "## E2 under MPS"; timeout 80 python /tmp/e2.py
  echo "## routings under MPS"; timeout -k 10 240 python -c "
import time, test_ep_gpu as t; t.TIMEOUT_S = 200; s = time.time()
for name in ('routings', 'errors', 'peer_never_launches'):
    try: t.run_spawned(name); print(name, 'PASSED', flush=True)
    except BaseException as e: print(name, 'FAILED:', str(e)[-3000:], flush=True)
    print('elapsed %.0f s' % (time.time() - s), flush=True)"
  echo quit | nvidia-cuda-mps-control; cat /tmp/mps-log/control.log | tail -5
fi
