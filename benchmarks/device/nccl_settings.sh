#!/usr/bin/env bash
# One device call (nvidia-h200-x2): the expert-parallel layer's collectives at its size (235 MB per GPU) under
# each NCCL/XLA setting below, one process each (benchmarks/collectives.py), and through PyTorch's NCCL with a
# plain peer copy as the link's ceiling (benchmarks/collectives_torch.py). NVLink multicast stays off
# (NCCL_NVLS_ENABLE=0 is the machine's; nothing here sets it). Writes $OUT/collectives.jsonl, $OUT/nccl.log.
set -u
out="$OUT/collectives.jsonl"
jaxrun() { local label=$1; shift
  env "$@" timeout 90 python3 benchmarks/collectives.py --label "$label" --out "$out" 2>&1 | grep -v cuda_timer; }
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING jaxrun default 2>&1 | tee "$OUT/nccl.log" | grep -v "NCCL INFO" 
grep -E "NCCL version|nChannels|channels|Channel 0[0-3]|Init COMPLETE|P2P|CUMEM|NVLS" "$OUT/nccl.log" | sort -u | head -30
jaxrun channels16 NCCL_MIN_NCHANNELS=16
jaxrun channels32 NCCL_MIN_NCHANNELS=32
jaxrun ctas32 NCCL_MIN_CTAS=32 NCCL_MAX_CTAS=32
jaxrun proto_simple NCCL_PROTO=Simple
jaxrun buffsize16M NCCL_BUFFSIZE=16777216
jaxrun nthreads512 NCCL_NTHREADS=512
jaxrun channels32_buffsize16M NCCL_MIN_NCHANNELS=32 NCCL_BUFFSIZE=16777216
jaxrun user_buffers XLA_FLAGS=--xla_gpu_enable_nccl_user_buffers=true
jaxrun user_buffers_channels32 XLA_FLAGS=--xla_gpu_enable_nccl_user_buffers=true NCCL_MIN_NCHANNELS=32
echo "(${SECONDS}s)"
timeout 100 python3 benchmarks/collectives_torch.py --out "$out" 2>&1 | grep -v Warning | tail -5
NCCL_MIN_NCHANNELS=32 timeout 100 python3 benchmarks/collectives_torch.py --out "$out" 2>&1 | grep -v Warning | tail -5
echo "(${SECONDS}s)"
