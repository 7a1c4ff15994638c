/*
 * The CUDA copy engine: copy jobs between the daemon's pools (replicas of a version on another
 * device), run by the GPUs' copy engines on the daemon's own per-device copy streams, never on
 * the daemon's thread and never with kernels (a kernel would take SMs from the inference that
 * already runs on the target GPU; copy engines do not).
 *
 * A job copies segments along a chain: src -> dst[0] -> dst[1] -> ... Each step of the chain
 * is a hop, run by one of four methods, chosen per hop from where its two ends lie:
 *   local   both ends on one GPU: cudaMemcpyAsync on that GPU's copy stream;
 *   peer    two GPUs with peer access: cudaMemcpyPeerAsync on the target GPU's copy stream
 *           (the target pulls); access to the source pool is granted to the target GPU once
 *           per (pool, device) and peer access enabled once per device pair;
 *   direct  one end in a host-NUMA pool (pinned host memory): cudaMemcpyAsync on the GPU end's
 *           copy stream (or the target pool's GPU when both ends are host memory), after
 *           granting that GPU access to the host pool;
 *   staged  two GPUs without peer access, or GPUPOOL_NO_PEER=1 in the environment: through a
 *           ring of SLOTS pinned host buffers of PIECE bytes each (cudaHostAlloc, kept for the
 *           next job), device-to-host on the source GPU's copy stream and host-to-device on
 *           the target's, so both directions of PCIe run at once. The piece in a slot serves
 *           every staged hop of the chain (it is the same bytes), so a staged broadcast reads
 *           the source once.
 * The segments are cut into pieces (16 MiB when a hop stages, 128 MiB along a chain of peer
 * copies, none for one destination without staging; small segments share one) and the whole
 * job is queued at copy_start, piece by piece: piece k of hop h waits (an event, on the
 * GPU) for piece k of hop h-1, so dst[1] gets piece k-1 from dst[0] while dst[0] gets piece k,
 * and n destinations cost about one copy time plus n-1 pieces. Each hop records its piece into
 * one of SLOTS events (a ring: a stream wait takes the event's most recent record, and a
 * staging slot is refilled only after the waits on the hops that read it from SLOTS pieces
 * ago), so a job holds ndst * SLOTS + 1 events however long it is.
 *
 * The end of a job (copy_watch.c): a watcher thread (one per daemon) queries the last event of each hop of
 * every running job and writes the notifier's eventfd when a job's are all complete. It polls
 * each job at an interval of 1/256 of the time the job has run so far (4 us to 1 ms), so it
 * learns of an end at most about 0.4% of the job's time late, with a few thousand queries per
 * job however long, and sleeps on a condition variable while no job runs. A host function
 * (cudaLaunchHostFunc) after each hop did this before: measured on 2x H100, the eventfd came
 * 155-161 us after the copy had ended (`gpupool_copy_bench notify`), most of what a get that
 * makes a replica adds to the copy itself.
 *
 * Costs on the caller's thread: copy_start issues about (pieces + segments) * ndst CUDA calls
 * (a few microseconds each: 2.3 ms for a 290-tensor 15 GB broadcast to three GPUs); the first
 * staged job pins its ring (tens of ms, once); copy_poll queries ndst events; copy_free of a
 * running job waits until its queued copies have run (at most the job's remaining copy time:
 * CUDA cannot take back queued copies, and the caller frees the slabs as soon as it returns).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cuda.h"
#include "copy_internal.h"
#include "cuda_daemon.h"
#include "errors.h"
#include "list.h"
#include "log.h"
#include "vmm.h"

static const char *const hop_names[] = {"local", "peer", "direct", "staged"};

/* A position in the job's bytes: segment i, offset off into it. */
typedef struct {
  size_t seg;
  uint64_t off;
} cursor;

static int copy_stream(gpupool__cuda_state *st, int device, cudaStream_t *out) {
  gpupool__cuda_dev *d = &st->dev[device];
  cudaError_t e;
  int rc;

  if ((rc = gpupool__cuda_set_device(device)) < 0)
    return rc;
  if (!d->has_copy_stream) {
    e = cudaStreamCreateWithFlags(&d->copy_stream, cudaStreamNonBlocking);
    if (e != cudaSuccess)
      return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaStreamCreateWithFlags (copy stream)",
                                device, NULL);
    d->has_copy_stream = 1;
  }
  *out = d->copy_stream;
  return 0;
}

/* 1 when device to's copy engines can reach device from's memory (peer access, enabled here
 * once per pair), 0 when not. */
static int peer_ok(gpupool__cuda_state *st, int from, int to) {
  signed char *s = &st->peer[from * st->ndev + to];
  int can = 0;
  cudaError_t e;

  if (*s)
    return *s > 0;
  *s = -1;
  e = cudaDeviceCanAccessPeer(&can, to, from);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    GPUPOOL__WARN("cuda: cudaDeviceCanAccessPeer(%d, %d): %s; copies from device %d to %d are "
                  "staged through pinned host memory", to, from, cudaGetErrorName(e), from, to);
    return 0;
  }
  if (!can) {
    GPUPOOL__INFO("cuda: device %d cannot access device %d as a peer; copies between them are "
                  "staged through pinned host memory", to, from);
    return 0;
  }
  if (gpupool__cuda_set_device(to) < 0)
    return 0;
  e = cudaDeviceEnablePeerAccess(from, 0);
  if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    GPUPOOL__WARN("cuda: cudaDeviceEnablePeerAccess(%d) on device %d: %s (%s); copies between "
                  "them are staged through pinned host memory", from, to, cudaGetErrorName(e),
                  cudaGetErrorString(e));
    return 0;
  }
  (void)cudaGetLastError();
  *s = 1;
  return 1;
}

/* Give device access to pool p in this process (once). */
static int grant(gpupool__bpool *p, int device) {
  cudaError_t e;

  if (device == p->device)
    return 0; /* its own GPU: device pools always, host-NUMA pools since pool_create */
  if (device >= 64)
    return gpupool__err(GPUPOOL_ENOTSUP, "pool \"%s\": the copy engine cannot give device %d "
                        "access (devices 0 to 63 only): copy through a pool on a lower device",
                        p->name, device);
  if (p->copy_access & (1ull << device))
    return 0;
  if (p->vmm) {
    /* Access is per mapping: every slab mapped now, and (copy_access) every later one. */
    int rc;
    for (gpupool__cuda_vslab *v = p->vslabs; v; v = v->next)
      if ((rc = gpupool__vmm_access(v->va, v->mapped, device)) != 0)
        return rc;
    p->copy_access |= 1ull << device;
    return 0;
  }
  e = gpupool__cuda_pool_access(p->pool, device, cudaMemAccessFlagsProtReadWrite);
  if (e != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaMemPoolSetAccess (copy engine)", device,
                              "the copy needs this device to reach the pool's memory; set "
                              "GPUPOOL_NO_PEER=1 for gpupoold to stage copies through host "
                              "memory instead");
  p->copy_access |= 1ull << device;
  return 0;
}

void gpupool__cuda_copy_pool_forget(gpupool__bpool *p) {
  if (p->vmm) { /* the access went with each slab's mapping */
    p->copy_access = 0;
    return;
  }
  for (int d = 0; d < 64 && p->copy_access; d++) {
    cudaError_t e;
    if (!(p->copy_access & (1ull << d)))
      continue;
    p->copy_access &= ~(1ull << d);
    e = gpupool__cuda_pool_access(p->pool, d, cudaMemAccessFlagsProtNone);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      GPUPOOL__WARN("cuda: pool \"%s\": taking back device %d's access before destroying it: "
                    "%s (%s)", p->name, d, cudaGetErrorName(e), cudaGetErrorString(e));
    }
  }
}

static const gpupool__bloc *hop_from(const gpupool__bcopy_seg *s, int h) {
  return h == 0 ? &s->src : &s->dst[h - 1];
}

static int check_loc(const gpupool__bloc *l, uint64_t len, size_t i, const char *what) {
  if (!l->pool || !l->slab || !l->slab->priv)
    return gpupool__err(GPUPOOL_EINVAL, "copy segment %zu: its %s names no pool or slab", i, what);
  if (l->off > l->slab->size || len > l->slab->size - l->off)
    return gpupool__err(GPUPOOL_EINVAL, "copy segment %zu: %llu bytes at offset %llu run past "
                        "the end of its %s slab (%llu bytes)", i, (unsigned long long)len,
                        (unsigned long long)l->off, what, (unsigned long long)l->slab->size);
  return 0;
}

/* Check the segments, and that each end of each hop lies in one place for every segment (one
 * GPU's memory, or host memory of pools used by one GPU): a job is one chain of places. */
static int check_segs(const gpupool__bcopy_seg *segs, size_t nsegs, int ndst, hop *hops) {
  int rc;
  for (size_t i = 0; i < nsegs; i++) {
    const gpupool__bcopy_seg *s = &segs[i];
    if (s->len == 0)
      return gpupool__err(GPUPOOL_EINVAL, "copy segment %zu has no bytes", i);
    if ((rc = check_loc(&s->src, s->len, i, "source")) < 0)
      return rc;
    for (int h = 0; h < ndst; h++) {
      const gpupool__bpool *p = s->dst[h].pool;
      if ((rc = check_loc(&s->dst[h], s->len, i, "destination")) < 0)
        return rc;
      if (i == 0) {
        const gpupool__bpool *f = hop_from(s, h)->pool;
        hops[h].from_dev = f->device;
        hops[h].from_host = f->host;
        hops[h].to_dev = p->device;
        hops[h].to_host = p->host;
      } else if (p->device != hops[h].to_dev || p->host != hops[h].to_host) {
        return gpupool__err(GPUPOOL_EINVAL, "copy segment %zu: destination %d is in pool \"%s\" "
                            "(%s of device %d) but segment 0's is on %s of device %d: one job "
                            "copies along one chain of devices; split the job", i, h, p->name,
                            p->host ? "host memory" : "memory", p->device,
                            hops[h].to_host ? "host memory" : "memory", hops[h].to_dev);
      }
    }
    if (i > 0 && (s->src.pool->device != hops[0].from_dev ||
                  s->src.pool->host != hops[0].from_host))
      return gpupool__err(GPUPOOL_EINVAL, "copy segment %zu: its source pool \"%s\" lies "
                          "elsewhere than segment 0's: one job copies from one place; split "
                          "the job", i, s->src.pool->name);
  }
  return 0;
}

/* Choose each hop's method and stream, grant the access it needs. */
static int plan(gpupool__bcopy *c, const gpupool__bcopy_seg *segs, size_t nsegs) {
  gpupool__cuda_state *st = c->st;
  const char *np = getenv("GPUPOOL_NO_PEER");
  int no_peer = np && *np && strcmp(np, "0") != 0;
  int staged_seen = 0, rc;

  for (int h = 0; h < c->ndst; h++) {
    hop *H = &c->hops[h];
    if (H->from_host || H->to_host) {
      H->kind = HOP_DIRECT;
      H->dev = !H->to_host ? H->to_dev : !H->from_host ? H->from_dev : H->to_dev;
    } else if (H->from_dev == H->to_dev) {
      H->kind = HOP_LOCAL;
      H->dev = H->to_dev;
    } else if (!no_peer && peer_ok(st, H->from_dev, H->to_dev)) {
      H->kind = HOP_PEER;
      H->dev = H->to_dev;
    } else {
      H->kind = HOP_STAGED;
      H->dev = H->to_dev;
      if (!staged_seen) {
        H->fills_stage = 1;
        staged_seen = 1;
        if ((rc = copy_stream(st, H->from_dev, &H->d2h_stream)) < 0)
          return rc;
      }
    }
    if ((rc = copy_stream(st, H->dev, &H->stream)) < 0)
      return rc;
    /* The hop's GPU must reach both ends; every segment's pools, once per (pool, device). */
    if (H->kind == HOP_PEER || H->kind == HOP_DIRECT) {
      for (size_t i = 0; i < nsegs; i++) {
        if ((rc = grant(hop_from(&segs[i], h)->pool, H->dev)) < 0 ||
            (rc = grant(segs[i].dst[h].pool, H->dev)) < 0)
          return rc;
      }
    }
    for (int k = 0; k < SLOTS; k++) {
      gpupool__cuda_dev *D = &st->dev[H->dev];
      cudaError_t e;
      if (D->nev_idle > 0) { /* the device is current (copy_stream above) */
        H->ev[k] = D->ev_idle[--D->nev_idle];
        H->nev++;
        continue;
      }
      e = cudaEventCreateWithFlags(&H->ev[k], cudaEventDisableTiming);
      if (e != cudaSuccess)
        return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaEventCreateWithFlags (copy)", H->dev,
                                  NULL);
      H->nev++;
    }
    if (H->fills_stage) {
      cudaError_t e;
      if ((rc = gpupool__cuda_set_device(H->from_dev)) < 0)
        return rc;
      e = cudaEventCreateWithFlags(&c->d2h_ev, cudaEventDisableTiming);
      if (e != cudaSuccess)
        return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaEventCreateWithFlags (copy)",
                                  H->from_dev, NULL);
      c->has_d2h_ev = 1;
    }
  }
  c->piece = staged_seen ? PIECE : c->ndst > 1 ? PIECE_CHAIN : PIECE_ONE;
  if (staged_seen) {
    if (st->nstage_idle > 0) {
      c->stage = st->stage_idle[--st->nstage_idle];
    } else {
      cudaError_t e = cudaHostAlloc(&c->stage, SLOTS * PIECE, cudaHostAllocPortable);
      if (e != cudaSuccess) {
        c->stage = NULL;
        return gpupool__cuda_fail(GPUPOOL_ENOMEM, e, "cudaHostAlloc (staging ring)", -1,
                                  "a staged copy needs a ring of pinned host memory (128 MiB "
                                  "as built by default): raise the locked-memory limit "
                                  "(LimitMEMLOCK=) or free host memory");
      }
    }
  }
  return 0;
}

/* The end of the piece that starts at cur: as many whole segments or parts of one as fit in
 * piece bytes. */
static cursor piece_end(const gpupool__bcopy_seg *segs, size_t nsegs, cursor cur, uint64_t piece) {
  uint64_t room = piece;
  while (cur.seg < nsegs && room > 0) {
    uint64_t left = segs[cur.seg].len - cur.off;
    if (left > room) {
      cur.off += room;
      break;
    }
    room -= left;
    cur.seg++;
    cur.off = 0;
  }
  return cur;
}

static char *loc_ptr(const gpupool__bloc *l, uint64_t off) {
  return (char *)l->slab->priv + l->off + off;
}

/* The next range of the piece that ends at b, from *r: its segment, the offset into it and
 * its length; 0 once the piece is done. */
static int next_range(const gpupool__bcopy_seg *segs, cursor *r, cursor b,
                      const gpupool__bcopy_seg **s, uint64_t *off, uint64_t *len) {
  if (r->seg > b.seg || (r->seg == b.seg && r->off >= b.off))
    return 0;
  *s = &segs[r->seg];
  *off = r->off;
  *len = (r->seg == b.seg ? b.off : (*s)->len) - r->off;
  r->seg++;
  r->off = 0;
  return 1;
}

static int cu(cudaError_t e, const char *call, int device) {
  if (e == cudaSuccess)
    return 0;
  return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, call, device,
                            "the copy was abandoned; its destinations hold unspecified bytes");
}

/* Queue piece k ([a, b)) on every hop. */
static int queue_piece(gpupool__bcopy *c, const gpupool__bcopy_seg *segs, uint64_t k, cursor a,
                       cursor b) {
  int slot = (int)(k % SLOTS), rc;
  char *ring = c->stage ? (char *)c->stage + (size_t)slot * PIECE : NULL;

  for (int h = 0; h < c->ndst; h++) {
    hop *H = &c->hops[h];
    const gpupool__bcopy_seg *s;
    uint64_t poff, off, len;
    cursor r;
    if (H->kind == HOP_STAGED && H->fills_stage) {
      /* cudaMemcpyAsync refuses (cudaErrorInvalidValue) a stream of another device than the
       * current one when pool memory is involved: every hop sets its device first. */
      if ((rc = gpupool__cuda_set_device(H->from_dev)) < 0)
        return rc;
      /* The slot is free once every staged hop has read the piece SLOTS before this one. */
      if (k >= SLOTS)
        for (int g = h; g < c->ndst; g++)
          if (c->hops[g].kind == HOP_STAGED &&
              (rc = cu(cudaStreamWaitEvent(H->d2h_stream, c->hops[g].ev[slot], 0),
                       "cudaStreamWaitEvent (staging slot)", H->from_dev)) < 0)
            return rc;
      if (h > 0 && (rc = cu(cudaStreamWaitEvent(H->d2h_stream, c->hops[h - 1].ev[slot], 0),
                            "cudaStreamWaitEvent (chain)", H->from_dev)) < 0)
        return rc;
      for (r = a, poff = 0; next_range(segs, &r, b, &s, &off, &len); poff += len)
        if ((rc = cu(cudaMemcpyAsync(ring + poff, loc_ptr(hop_from(s, h), off), len,
                                     cudaMemcpyDeviceToHost, H->d2h_stream),
                     "cudaMemcpyAsync (staging, device to host)", H->from_dev)) < 0)
          return rc;
      if ((rc = cu(cudaEventRecord(c->d2h_ev, H->d2h_stream), "cudaEventRecord (staging)",
                   H->from_dev)) < 0)
        return rc;
    }
    if ((rc = gpupool__cuda_set_device(H->dev)) < 0)
      return rc;
    if (H->kind == HOP_STAGED) {
      if ((rc = cu(cudaStreamWaitEvent(H->stream, c->d2h_ev, 0), "cudaStreamWaitEvent (staging)",
                   H->dev)) < 0)
        return rc;
    } else if (h > 0 && c->hops[h - 1].stream != H->stream &&
               (rc = cu(cudaStreamWaitEvent(H->stream, c->hops[h - 1].ev[slot], 0),
                        "cudaStreamWaitEvent (chain)", H->dev)) < 0) {
      return rc;
    }
    for (r = a, poff = 0; next_range(segs, &r, b, &s, &off, &len); poff += len) {
      char *dst = loc_ptr(&s->dst[h], off);
      cudaError_t e;
      switch (H->kind) {
      case HOP_STAGED:
        e = cudaMemcpyAsync(dst, ring + poff, len, cudaMemcpyHostToDevice, H->stream);
        break;
      case HOP_PEER:
        e = cudaMemcpyPeerAsync(dst, H->to_dev, loc_ptr(hop_from(s, h), off), H->from_dev, len,
                                H->stream);
        break;
      default:
        e = cudaMemcpyAsync(dst, loc_ptr(hop_from(s, h), off), len, cudaMemcpyDefault, H->stream);
        break;
      }
      if ((rc = cu(e, H->kind == HOP_PEER ? "cudaMemcpyPeerAsync" : "cudaMemcpyAsync",
                   H->dev)) < 0)
        return rc;
    }
    if ((rc = cu(cudaEventRecord(H->ev[slot], H->stream), "cudaEventRecord (copy)", H->dev)) < 0)
      return rc;
  }
  return 0;
}

/* Give the ring back to the cache (or to the system) once nothing uses it. */
static void stage_put(gpupool__bcopy *c) {
  gpupool__cuda_state *st = c->st;
  if (!c->stage)
    return;
  if (st->nstage_idle < GPUPOOL__CUDA_STAGE_KEEP) {
    st->stage_idle[st->nstage_idle++] = c->stage;
  } else if (cudaFreeHost(c->stage) != cudaSuccess) {
    (void)cudaGetLastError();
    GPUPOOL__WARN("cuda: cudaFreeHost of a staging ring failed");
  }
  c->stage = NULL;
}

/* Free c's events (kept for the next jobs while there is room: every record in them has
 * completed, and a job's first waits on a slot it has not recorded yet then wait for nothing)
 * and ring; its work must have completed (or never been queued). */
static void job_free(gpupool__bcopy *c) {
  gpupool__cuda_watch_remove(c);
  for (int h = 0; h < c->ndst; h++) {
    gpupool__cuda_dev *D = &c->st->dev[c->hops[h].dev];
    for (int k = 0; k < c->hops[h].nev; k++) {
      if (D->nev_idle < GPUPOOL__CUDA_EVENTS_KEEP)
        D->ev_idle[D->nev_idle++] = c->hops[h].ev[k];
      else if (cudaEventDestroy(c->hops[h].ev[k]) != cudaSuccess)
        (void)cudaGetLastError();
    }
  }
  if (c->has_d2h_ev && cudaEventDestroy(c->d2h_ev) != cudaSuccess)
    (void)cudaGetLastError();
  stage_put(c);
  free(c);
}

/* Wait for everything c may have queued on its streams (the error path of copy_start, when
 * some pieces were queued and their events may be partial). */
static void job_drain(gpupool__bcopy *c) {
  for (int h = 0; h < c->ndst; h++) {
    hop *H = &c->hops[h];
    if (H->stream && cudaStreamSynchronize(H->stream) != cudaSuccess)
      (void)cudaGetLastError();
    if (H->d2h_stream && cudaStreamSynchronize(H->d2h_stream) != cudaSuccess)
      (void)cudaGetLastError();
  }
}

int gpupool__cuda_copy_notify_fd(gpupool__backend *be) { return ((gpupool__cuda_state *)be->priv)->copy_efd; }

void gpupool__cuda_copy_init(gpupool__cuda_state *st) {
  /* -1 when the kernel refuses one: the caller's timer then polls alone. */
  st->copy_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  st->watch = NULL;
  if (st->copy_efd >= 0)
    gpupool__cuda_watch_start(st);
}

/* Runs on a CUDA driver thread once a hop's stream reaches it: no CUDA call here. */
static void CUDART_CB notify_cb(void *arg) {
  gpupool__cuda_state *st = arg;
  uint64_t one = 1;
  ssize_t r = write(st->copy_efd, &one, sizeof one);
  (void)r; /* the counter saturating still leaves it readable */
}

int gpupool__cuda_copy_start(gpupool__backend *be, const gpupool__bcopy_seg *segs, size_t nsegs,
                             int ndst, gpupool__bcopy **out) {
  gpupool__bcopy *c;
  cursor a = {0, 0};
  uint64_t bytes = 0;
  int rc;

  *out = NULL;
  if (!segs || nsegs == 0)
    return gpupool__err(GPUPOOL_EINVAL, "a copy job needs at least one segment");
  if (ndst < 1 || ndst > GPUPOOL_COPY_MAX_DSTS)
    return gpupool__err(GPUPOOL_EINVAL, "a copy job has 1 to %d destinations, not %d",
                        GPUPOOL_COPY_MAX_DSTS, ndst);
  c = calloc(1, sizeof(*c));
  if (!c)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory starting a copy job");
  c->st = be->priv;
  c->ndst = ndst;
  if ((rc = check_segs(segs, nsegs, ndst, c->hops)) < 0)
    goto fail;
  if ((rc = plan(c, segs, nsegs)) < 0)
    goto fail;
  while (a.seg < nsegs) {
    cursor b = piece_end(segs, nsegs, a, c->piece);
    if ((rc = queue_piece(c, segs, c->npieces, a, b)) < 0) {
      job_drain(c);
      goto fail;
    }
    c->npieces++;
    a = b;
  }
  /* Tell the loop when the job is through: the watcher, else a host function after each hop
   * (its last piece's event is then complete); a hop whose host function cannot be queued is
   * still found by the caller's timer. */
  if (c->st->watch)
    gpupool__cuda_watch_add(c);
  else if (c->st->copy_efd >= 0)
    for (int h = 0; h < ndst; h++)
      if (cudaLaunchHostFunc(c->hops[h].stream, notify_cb, c->st) != cudaSuccess)
        (void)cudaGetLastError();
  for (size_t i = 0; i < nsegs; i++)
    bytes += segs[i].len;
  if (gpupool__log_get_level() >= GPUPOOL_LOG_DEBUG) {
    char how[GPUPOOL_COPY_MAX_DSTS * 32];
    size_t l = 0;
    how[0] = '\0';
    for (int h = 0; h < ndst && l < sizeof(how); h++) {
      const hop *H = &c->hops[h];
      int n = snprintf(how + l, sizeof(how) - l, "%s%s%d->%s%d %s", h ? ", " : "",
                       H->from_host ? "host@" : "gpu", H->from_dev, H->to_host ? "host@" : "gpu",
                       H->to_dev, hop_names[H->kind]);
      if (n < 0)
        break;
      l += (size_t)n;
    }
    GPUPOOL__DEBUG("cuda: copy job: %zu segments, %llu bytes, %llu pieces: %s", nsegs,
                   (unsigned long long)bytes, (unsigned long long)c->npieces, how);
  }
  *out = c;
  return 0;

fail:
  job_free(c);
  return rc;
}

int gpupool__cuda_copy_poll(gpupool__bcopy *c) {
  int h = 0, q;
  cudaError_t e = cudaSuccess;
  if (c->done)
    return 1;
  if ((q = gpupool__cuda_job_state(c, &h, &e)) == 0)
    return 0;
  if (q < 0)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaEventQuery (copy job)", c->hops[h].dev,
                              "the copy failed; its destinations hold unspecified bytes");
  c->done = 1;
  stage_put(c); /* every read of the ring has completed */
  return 1;
}

void gpupool__cuda_copy_free(gpupool__bcopy *c) {
  if (!c)
    return;
  if (!c->done) {
    /* CUDA cannot take back queued copies: wait for them, since the caller frees the slabs
     * next. Each hop's last event covers its stream's part of the job (and the staging
     * copies it waited on). */
    int slot = (int)((c->npieces - 1) % SLOTS);
    for (int h = 0; h < c->ndst; h++) {
      cudaError_t e = cudaEventSynchronize(c->hops[h].ev[slot]);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        GPUPOOL__WARN("cuda: waiting for a cancelled copy on device %d: %s; synchronizing its "
                      "stream", c->hops[h].dev, cudaGetErrorName(e));
        job_drain(c);
        break;
      }
    }
  }
  job_free(c);
}

void gpupool__cuda_copy_close(gpupool__cuda_state *st) {
  gpupool__cuda_watch_stop(st); /* before the events it queries go and the eventfd it writes closes */
  while (st->nstage_idle > 0)
    if (cudaFreeHost(st->stage_idle[--st->nstage_idle]) != cudaSuccess)
      (void)cudaGetLastError();
  for (int d = 0; d < st->ndev; d++) {
    if (!st->dev[d].has_copy_stream)
      continue;
    if (st->dev[d].nev_idle > 0 && cudaSetDevice(d) != cudaSuccess)
      (void)cudaGetLastError();
    while (st->dev[d].nev_idle > 0)
      if (cudaEventDestroy(st->dev[d].ev_idle[--st->dev[d].nev_idle]) != cudaSuccess)
        (void)cudaGetLastError();
    /* Its last host functions run before the eventfd they write to is closed. */
    if (cudaSetDevice(d) != cudaSuccess || cudaStreamSynchronize(st->dev[d].copy_stream) != cudaSuccess)
      (void)cudaGetLastError();
    if (cudaSetDevice(d) != cudaSuccess || cudaStreamDestroy(st->dev[d].copy_stream) != cudaSuccess) {
      (void)cudaGetLastError();
      GPUPOOL__WARN("cuda: cannot destroy the copy stream of device %d", d);
    }
    st->dev[d].has_copy_stream = 0;
  }
  if (st->copy_efd >= 0) {
    close(st->copy_efd);
    st->copy_efd = -1;
  }
}
