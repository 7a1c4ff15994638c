#!/usr/bin/env bash
# Build the benchmark on a build machine, run it on a GPU machine.
#
#   tools/gpu-bench.sh [build]  On the build machine: the same build as tools/gpu-test.sh
#                               (build-gpu/, static libuv and protobuf-c), which includes
#                               build-gpu/bench/gpupool_bench and gpupool_pinned_bench. Carry
#                               the repository, build-gpu/ included, to the GPU machine.
#   tools/gpu-bench.sh run      On the GPU machine, from the repository root: runs
#                               gpupool_bench (its own private gpupoold on GPU 0), then
#                               bench/torch_peer.py (torch.multiprocessing peer; skipped when
#                               torch is missing), then bench/file_share.py (N = 1, 4, 8
#                               consumers bring one FILE_SIZE (default 4G) file to the GPU:
#                               gpupool file object vs np.load / cupy.load), and prints a
#                               table of the key figures with ratios; then
#                               gpupool_pinned_bench (copy throughput of a host-NUMA pool
#                               buffer against cudaMallocHost and pageable memory, its own
#                               private gpupoold; skipped when GPU 0 lacks host-NUMA pools),
#                               whose table is appended. With $OUT set, the full log and the
#                               tables are written to $OUT/gpu-bench.log and
#                               $OUT/gpu-bench-table.md, the pinned table alone also to
#                               $OUT/pinned-bench-table.md. Last, bench/weight_sync.py (a
#                               state dict handed over version after version by
#                               torch.multiprocessing, a flattened bucket and gpupool
#                               bundles; skipped without torch): its table is appended and
#                               also written to $OUT/weight-sync-table.md (five runs,
#                               with their spread). Then bench/torch_data.py (DataLoader
#                               batches to the GPU: pin_memory=True against PinnedLoader)
#                               and bench/torch_queue.py (CUDA tensors and a state dict
#                               through mp.Queue with and without gpupool.torch.install();
#                               skipped without it) and bench/torch_floor.py (what a
#                               Python reducer's torch calls cost per tensor): tables
#                               appended, and written to $OUT/torch-data-table.md and
#                               $OUT/torch-queue-table.md, and bench/torch_msg_profile.py
#                               (one message's steps on each side; gpupool.torch's C
#                               extension from this build, $GPUPOOL_FAST_MODULE, as every
#                               Python benchmark here). Then gpupool_survive_bench
#                               (survive=yes pools against stream-ordered ones; kill -9 to
#                               the first served get with SURVIVE_GB GiB, default 32),
#                               bench/torch_train_step.py and bench/torch_ipc_deadlock.py.
#   tools/gpu-bench.sh multi    On a GPU machine with two GPUs or more (four for the whole
#                               broadcast): prints `nvidia-smi topo -m`, then runs
#                               build-gpu/bench/gpupool_copy_bench peer, staged and broadcast
#                               (the CUDA copy engine against raw cudaMemcpyPeerAsync, against
#                               cudaMemcpyPeer without peer access, and a 290-tensor broadcast
#                               from GPU 0 to GPUs 1-3 through one chained job), each in a
#                               process of its own, then bench/broadcast_nccl.py (the same
#                               broadcast with torch.distributed and NCCL, 4 ranks; skipped
#                               without torch), then build-gpu/bench/gpupool_replica_bench
#                               peer, staged, broadcast and getters (the same figures end to
#                               end through a private gpupoold: a get on GPU 1 against raw
#                               cudaMemcpyPeerAsync, staged against cudaMemcpyPeer, the state
#                               dict published with gpupool_bundle_publish_to to getters
#                               waiting on GPUs 1-3, 8 getters sharing one copy), and last a
#                               table of the broadcast end to end next to NCCL's, with the
#                               ratios. MULTI_QUICK=1 passes --quick (two runs of each
#                               figure: to check that it runs). With $OUT set, the log and
#                               the tables go to $OUT/multi-bench.log and
#                               $OUT/multi-bench-table.md.
#
# Paths are relative to the repository root, so the tree may live anywhere on the GPU machine.
# PYTHON selects the interpreter for the torch peer (default python3).
set -euo pipefail

cd "$(dirname "$0")/.."
build="build-gpu"

die() { echo "gpu-bench.sh: $*" >&2; exit 1; }

# After a benchmark that writes its own table: append_part RC ITS_TABLE WHAT TITLE LOG
# SKIP_PREFIX PROGRAM appends ITS_TABLE to $table when it ran (RC 0), a "TITLE: skipped (why)"
# line when it skipped (77; why is the rest of LOG's first line starting with SKIP_PREFIX),
# and stops when PROGRAM failed.
append_part() {
  case "$1" in
    0) printf '\n' >> "$table"; cat "$2" >> "$table" ;;
    77) echo "gpu-bench.sh: $3 benchmark skipped (see above)"
        printf '\n%s: skipped (%s)\n' "$4" "$(sed -n "s/^$6//p" "$5" | head -n1)" >> "$table" ;;
    *) die "$7 failed with status $1 (log above)" ;;
  esac
}

run_bench() {
  local bench="$build/bench/gpupool_bench" daemon="$build/daemon/gpupoold" log table rc
  local pinned="$build/bench/gpupool_pinned_bench" ptable plog prc wtable
  [ -x "$bench" ] || die "$bench missing: run tools/gpu-bench.sh build on the build machine"
  [ -x "$pinned" ] || die "$pinned missing: run tools/gpu-bench.sh build on the build machine"
  [ -x "$daemon" ] || die "$daemon missing: run tools/gpu-bench.sh build on the build machine"
  # gpupool.torch's C extension and use_allocator()'s library from this build: without them
  # the Python benchmarks would measure the pure-Python path (or skip the allocator's way).
  if [ -z "${GPUPOOL_FAST_MODULE:-}" ] && [ -f "$build/python/ext/_fast.abi3.so" ]; then
    export GPUPOOL_FAST_MODULE="$PWD/$build/python/ext/_fast.abi3.so"
  fi
  if [ -z "${GPUPOOL_TORCH_ALLOC_LIBRARY:-}" ] && [ -f "$build/client/libgpupool-torch-alloc.so" ]; then
    export GPUPOOL_TORCH_ALLOC_LIBRARY="$PWD/$build/client/libgpupool-torch-alloc.so"
  fi
  log=$(mktemp)
  table=$(mktemp)
  ptable=$(mktemp)
  plog=$(mktemp)
  set +e
  "$bench" "$daemon" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" = 77 ]; then
    echo "gpu-bench.sh: skipped: no usable CUDA device here (see above)"
    rm -f "$log" "$table" "$ptable" "$plog"
    exit 77
  fi
  [ "$rc" = 0 ] || die "gpupool_bench failed with status $rc (log above)"
  set +e
  "${PYTHON:-python3}" bench/torch_peer.py 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  case "$rc" in
    0) ;;
    77) echo "gpu-bench.sh: torch peer skipped (see above); its columns stay empty" ;;
    *) die "bench/torch_peer.py failed with status $rc (log above)" ;;
  esac
  # Read-only file objects: N consumers bring one file to the GPU (FILE_SIZE, default 4G;
  # FILE_DIR: where the file goes, default $TMPDIR).
  set +e
  LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "${PYTHON:-python3}" bench/file_share.py --gpupoold "$daemon" \
    --library "$build/client/libgpupool-client.so" --size "${FILE_SIZE:-4G}" \
    ${FILE_DIR:+--dir "$FILE_DIR"} 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  case "$rc" in
    0) ;;
    77) echo "gpu-bench.sh: file-share benchmark skipped (see above)" ;;
    *) die "bench/file_share.py failed with status $rc (log above)" ;;
  esac

  awk '
    $1 == "BENCH" { v[$2] = $3 }
    $1 == "BENCH_INFO" && $2 == "device" { $1 = ""; $2 = ""; sub(/^ +/, ""); dev = $0 }
    function f(k) { return (k in v) ? sprintf("%.1f", v[k]) : "-" }
    function r(a, b) { return ((a in v) && (b in v) && v[b] > 0) ? sprintf("%.2fx", v[a] / v[b]) : "-" }
    END {
      printf "gpupool vs torch.multiprocessing on %s (p50/p99 in microseconds)\n\n", dev
      printf "| handoff | gpupool warm p50 | gpupool warm p99 | gpupool cold p50 | gpupool cold p99 | torch p50 | torch p99 | torch p50 / gpupool warm p50 |\n"
      printf "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
      n = split("4096 1048576 67108864", sz, " ")
      split("4 KiB,1 MiB,64 MiB", lab, ",")
      for (i = 1; i <= n; i++) {
        w = "handoff_warm_" sz[i]; c = "handoff_cold_" sz[i]; t = "torch_handoff_" sz[i]
        printf "| %s | %s | %s | %s | %s | %s | %s | %s |\n", lab[i], f(w "_p50_us"), f(w "_p99_us"),
               f(c "_p50_us"), f(c "_p99_us"), f(t "_p50_us"), f(t "_p99_us"), r(t "_p50_us", w "_p50_us")
      }
      printf "\n| figure | value |\n| --- | --- |\n"
      printf "| socketpair round trip p50 / p99 (us) | %s / %s |\n", f("socket_rtt_p50_us"), f("socket_rtt_p99_us")
      printf "| warm gpupool_buffer_alloc p50 / p99 (us) | %s / %s |\n", f("alloc_p50_us"), f("alloc_p99_us")
      printf "| wake-up floor after 2 ms idle, 1 hop / 2 hops, p50 (us) | %s / %s |\n", f("wake_1hop_p50_us"), f("wake_2hop_p50_us")
      printf "| torch 1 MiB p50 / 2-hop wake-up floor p50 (the most any default-mode handoff through a sleeping daemon can reach) | %s |\n", r("torch_handoff_1048576_p50_us", "wake_2hop_p50_us")
      printf "| gpupool_buffer_alloc p50 / socket floor p50 | %s |\n", r("alloc_p50_us", "socket_rtt_p50_us")
      printf "| warm alloc+release p50 / p99 (us) | %s / %s |\n", f("alloc_release_p50_us"), f("alloc_release_p99_us")
      printf "| raw cudaMemPoolExportPointer 1 MiB p50 (us) | %s |\n", f("raw_export_ptr_p50_us")
      printf "| raw cudaMemPoolImportPointer 1 MiB p50 (us) | %s |\n", f("raw_import_ptr_p50_us")
      printf "| raw cudaIpcOpenEventHandle first / later p50 (us) | %s / %s |\n", f("raw_ipc_open_event_first_us"), f("raw_ipc_open_event_p50_us")
      printf "| raw cudaStreamWaitEvent p50 (us) | %s |\n", f("raw_stream_wait_event_p50_us")
      printf "| bundle from C, 146 bf16 tensors 2.47 GB: cold / warm p50 / warm p99 (us) | %s / %s / %s |\n", f("bundle_llama146_cold_us"), f("bundle_llama146_warm_p50_us"), f("bundle_llama146_warm_p99_us")
      printf "| same without GPUPOOL_KEEP_MAPPED (the slab imported again each version): cold / warm p50 / warm p99 (us) | %s / %s / %s |\n", f("bundle_llama146_nokeep_cold_us"), f("bundle_llama146_nokeep_warm_p50_us"), f("bundle_llama146_nokeep_warm_p99_us")
      printf "| bundle from C, 1,000 x 64 KiB: cold / warm p50 / warm p99 (us) | %s / %s / %s |\n", f("bundle_small1000_cold_us"), f("bundle_small1000_warm_p50_us"), f("bundle_small1000_warm_p99_us")
      printf "| handoffs/s, 1 producer -> 4 consumers (64 KiB) | %s |\n", f("handoffs_per_s_1p4c")
      printf "| alloc+release ops/s, 16 processes (64 KiB) | %s |\n", f("alloc_release_ops_per_s_16p")
      printf "| read GB/s shared 1 GiB / local cudaMalloc | %s / %s (%s) |\n", f("bw_shared_gbps"), f("bw_local_gbps"), r("bw_shared_gbps", "bw_local_gbps")
    }' "$log" > "$table"
  # The file-share table, as bench/file_share.py printed it.
  sed -n '/^FILE_SHARE_TABLE_BEGIN$/,/^FILE_SHARE_TABLE_END$/{/^FILE_SHARE_TABLE/d;p}' "$log" |
    { if read -r first; then echo; echo "$first"; cat; fi; } >> "$table"

  # The pinned tier: its own daemon, so it runs after the others are done with theirs.
  echo
  set +e
  "$pinned" "$daemon" "$ptable" 2>&1 | tee "$plog"
  rc=${PIPESTATUS[0]}
  set -e
  cat "$plog" >> "$log"
  append_part "$rc" "$ptable" pinned-memory "Pinned host-NUMA benchmark" "$plog" "SKIP: " \
    gpupool_pinned_bench
  prc=$rc

  # Weight sync (issue 12): a state dict handed over version after version by torch.mp, a
  # flattened bucket and gpupool bundles; its own daemon too. Its table is appended.
  wtable=$(mktemp)
  set +e
  GPUPOOL_LIBRARY="$PWD/$build/client/libgpupool-client.so" OUT='' \
    "${PYTHON:-python3}" bench/weight_sync.py --gpupoold "$daemon" --table "$wtable" 2>&1 |
    tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  append_part "$rc" "$wtable" weight-sync "Weight sync" "$log" "weight_sync: SKIP: " \
    bench/weight_sync.py

  # PyTorch code as it is (issue 23): DataLoader batches to the GPU, pin_memory=True against
  # PinnedLoader; CUDA tensors and a state dict through mp.Queue with and without
  # gpupool.torch.install() (skipped where this tree lacks install()). Each its own daemon.
  dtable=$(mktemp)
  qtable=$(mktemp)
  set +e
  GPUPOOL_LIBRARY="$PWD/$build/client/libgpupool-client.so" OUT='' \
    "${PYTHON:-python3}" bench/torch_data.py --gpupoold "$daemon" --table "$dtable" 2>&1 |
    tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  append_part "$rc" "$dtable" dataloader "DataLoader batches" "$log" "torch_data: SKIP: " \
    bench/torch_data.py
  set +e
  GPUPOOL_LIBRARY="$PWD/$build/client/libgpupool-client.so" OUT='' \
    "${PYTHON:-python3}" bench/torch_queue.py --gpupoold "$daemon" --table "$qtable" 2>&1 |
    tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  append_part "$rc" "$qtable" torch-queue "torch.multiprocessing Queue" "$log" \
    "torch_queue: SKIP: " bench/torch_queue.py
  # What the torch and pickle calls any Python-level reducer makes cost per tensor (no daemon).
  ftable=$(mktemp)
  set +e
  "${PYTHON:-python3}" bench/torch_floor.py --table "$ftable" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  append_part "$rc" "$ftable" torch-floor "Per-tensor floor" "$log" "torch_floor: SKIP: " \
    bench/torch_floor.py
  # One gpupool.torch message without the Queue, each side's steps (its summary lines).
  mtable=$(mktemp)
  set +e
  GPUPOOL_LIBRARY="$PWD/$build/client/libgpupool-client.so" \
    "${PYTHON:-python3}" bench/torch_msg_profile.py --gpupoold "$daemon" --top 0 2>&1 | tee -a "$log" |
    grep '^torch_msg_profile: ' | sed 's/^/    /' > "$mtable"
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" != 0 ] || sed -i '1i One gpupool.torch message, step by step (bench/torch_msg_profile.py):\n' "$mtable"
  append_part "$rc" "$mtable" torch-msg-profile "One gpupool.torch message, step by step" "$log" \
    "torch_msg_profile: SKIP: " bench/torch_msg_profile.py

  # Surviving pools (survive=yes): their cost against stream-ordered pools, and kill -9 to the
  # first served get with SURVIVE_GB GiB (default 32) and with 10,000 names. Then a training
  # step under use_allocator() and test_cuda_ipc_deadlock's pattern (both skipped without
  # torch and transformers). Their tables as they print them.
  stable=$(mktemp)
  set +e
  GPUPOOL_BENCH_SURVIVE_GB="${SURVIVE_GB:-32}" "$build/bench/gpupool_survive_bench" "$daemon" all 2>&1 |
    tee -a "$log" | grep '^|' > "$stable"
  rc=${PIPESTATUS[0]}
  for py in bench/torch_train_step.py bench/torch_ipc_deadlock.py; do
    [ "$rc" = 0 ] || break
    "${PYTHON:-python3}" -c 'import torch, transformers' 2>/dev/null || { echo "gpu-bench.sh: $py skipped (no torch or transformers)"; continue; }
    GPUPOOL_LIBRARY="$PWD/$build/client/libgpupool-client.so" \
      "${PYTHON:-python3}" "$py" --gpupoold "$daemon" 2>&1 | tee -a "$log" | grep '^|' >> "$stable"
    rc=${PIPESTATUS[0]}
  done
  set -e
  append_part "$rc" "$stable" survive "Surviving pools, a training step, the IPC deadlock pattern" "$log" \
    "SKIP: " gpupool_survive_bench

  echo
  cat "$table"
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$log" "$OUT/gpu-bench.log"
    cp "$table" "$OUT/gpu-bench-table.md"
    if [ "$prc" = 0 ]; then
      cp "$ptable" "$OUT/pinned-bench-table.md"
    fi
    if [ -s "$wtable" ]; then
      cp "$wtable" "$OUT/weight-sync-table.md"
    fi
    [ ! -s "$dtable" ] || cp "$dtable" "$OUT/torch-data-table.md"
    [ ! -s "$qtable" ] || cp "$qtable" "$OUT/torch-queue-table.md"
  fi
  rm -f "$log" "$table" "$ptable" "$plog" "$wtable" "$dtable" "$qtable" "$stable"
}

# Several GPUs: the copy engine and NCCL's broadcast (issue 24).
run_multi() {
  local cb="$build/bench/gpupool_copy_bench" rb="$build/bench/gpupool_replica_bench" log table rc
  [ -x "$cb" ] || die "$cb missing: run tools/gpu-bench.sh build on the build machine"
  [ -x "$rb" ] || die "$rb missing: run tools/gpu-bench.sh build on the build machine"
  log=$(mktemp)
  table=$(mktemp)
  {
    echo "Copy engine on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)" \
         "x $(nvidia-smi -L | wc -l), driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n1)"
    echo
    echo '```'
    nvidia-smi topo -m
    echo '```'
  } > "$table" 2>&1 || true
  cat "$table"
  for mode in peer staged broadcast; do
    set +e
    LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$cb" "$mode" --table "$table" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    set -e
    case "$rc" in
      0) ;;
      77) echo "gpu-bench.sh: copy benchmark skipped (fewer than two GPUs)"; rm -f "$log" "$table"; exit 77 ;;
      *) die "gpupool_copy_bench $mode failed with status $rc (log above)" ;;
    esac
  done
  set +e
  "${PYTHON:-python3}" bench/broadcast_nccl.py --table "$table" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  case "$rc" in
    0) ;;
    77) echo "gpu-bench.sh: NCCL broadcast skipped (see above)"; printf '\nNCCL broadcast: skipped\n' >> "$table" ;;
    *) die "bench/broadcast_nccl.py failed with status $rc (log above)" ;;
  esac
  # The replicas end to end: each mode with its own gpupoold, in a process of its own.
  for mode in peer staged broadcast getters; do
    set +e
    LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      "$rb" "$mode" "$build/daemon/gpupoold" "$build/tools/gpupoolctl" --table "$table" \
      ${MULTI_QUICK:+--quick} 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    set -e
    case "$rc" in
      0) ;;
      77) echo "gpu-bench.sh: replica benchmark $mode skipped (see above)"
          printf '\nReplica benchmark %s: skipped\n' "$mode" >> "$table" ;;
      *) die "gpupool_replica_bench $mode failed with status $rc (log above)" ;;
    esac
  done
  # The broadcast end to end next to the engine alone and NCCL (ratio: gpupool's end to end time
  # over that figure's; at most 1 where gpupool is no slower).
  awk '
    $1 == "BENCH" { v[$2] = $3 }
    END {
      g = "replica_broadcast_ms"
      if (!(g in v)) exit
      printf "\n| state dict broadcast, GPU 0 -> GPUs 1-3 | ms (median) | gpupool end to end / this |\n| --- | --- | --- |\n"
      printf "| gpupool end to end: gpupool_bundle_publish_to until every getter holds a usable replica | %.1f | 1.00 |\n", v[g]
      split("copy_broadcast_chain_ms nccl_broadcast_per_tensor_ms nccl_broadcast_bucket_ms", k, " ")
      split("copy engine alone, one chained job (copy_bench)|NCCL torch.distributed.broadcast per tensor|NCCL one flat bucket", lab, "|")
      for (i = 1; i <= 3; i++)
        if (k[i] in v)
          printf "| %s | %.1f | %.2f |\n", lab[i], v[k[i]], v[g] / v[k[i]]
        else
          printf "| %s | - | - |\n", lab[i]
    }' "$log" | tee -a "$table"
  echo
  cat "$table"
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$log" "$OUT/multi-bench.log"
    cp "$table" "$OUT/multi-bench-table.md"
  fi
  rm -f "$log" "$table"
}

case "${1:-build}" in
  build) exec tools/gpu-test.sh build ;;
  run) run_bench ;;
  multi) run_multi ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' ;;
  *) die "unknown mode '$1' (build, run or multi)" ;;
esac
