/*
 * The CUDA copy engine's watcher: one thread per daemon that queries the last event of each hop
 * of every running job and writes the notifier's eventfd when a job's are all complete, polling
 * each job at 1/256 of the time it has run so far (4 us to 1 ms) and sleeping while none runs.
 * Why a thread and not a host function after each hop: the top of copy.c.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "copy_internal.h"
#include "list.h"
#include "log.h"

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void watch_unlink(struct gpupool__cuda_watch *w, gpupool__bcopy *c) {
  GPUPOOL__LIST_UNLINK(w->head, c, wprev, wnext);
  c->wprev = c->wnext = NULL;
  c->watched = 0;
}

int gpupool__cuda_job_state(const gpupool__bcopy *c, int *which, cudaError_t *err) {
  int slot = (int)((c->npieces - 1) % SLOTS);
  for (int h = 0; h < c->ndst; h++) {
    cudaError_t e = cudaEventQuery(c->hops[h].ev[slot]);
    if (e == cudaSuccess)
      continue;
    (void)cudaGetLastError();
    if (e == cudaErrorNotReady)
      return 0;
    *which = h;
    *err = e;
    return -1;
  }
  return 1;
}

/* 1 when c is over, well or not (copy_poll reports a failure). */
static int job_ended(const gpupool__bcopy *c) {
  int h;
  cudaError_t e;
  return gpupool__cuda_job_state(c, &h, &e) != 0;
}

static void *watch_main(void *arg) {
  struct gpupool__cuda_watch *w = arg;
  uint64_t one = 1;
  /* Sleeps of a few microseconds mean what they say (the default slack is 50 us). */
  (void)prctl(PR_SET_TIMERSLACK, 1000ul, 0, 0, 0);
  pthread_mutex_lock(&w->mu);
  for (;;) {
    uint64_t now, nap = WATCH_MAX_NS;
    int ended = 0;
    while (!w->stop && !w->head)
      pthread_cond_wait(&w->cv, &w->mu);
    if (w->stop)
      break;
    now = mono_ns();
    for (gpupool__bcopy *c = w->head, *n; c; c = n) {
      uint64_t iv = (now - c->started_ns) / 256;
      n = c->wnext;
      if (job_ended(c)) {
        watch_unlink(w, c);
        ended = 1;
        continue;
      }
      iv = iv < WATCH_MIN_NS ? WATCH_MIN_NS : iv > WATCH_MAX_NS ? WATCH_MAX_NS : iv;
      if (iv < nap)
        nap = iv;
    }
    if (ended) {
      ssize_t r = write(w->efd, &one, sizeof one);
      (void)r; /* the counter saturating still leaves it readable */
    }
    if (w->head) {
      struct timespec ts = {0, (long)nap};
      pthread_mutex_unlock(&w->mu);
      nanosleep(&ts, NULL);
      pthread_mutex_lock(&w->mu);
    }
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

/* Start the watcher on the notifier's eventfd; st->watch stays NULL when it cannot start. */
void gpupool__cuda_watch_start(gpupool__cuda_state *st) {
  struct gpupool__cuda_watch *w = calloc(1, sizeof(*w));
  if (!w)
    return;
  w->efd = st->copy_efd;
  if (pthread_mutex_init(&w->mu, NULL) != 0) {
    free(w);
    return;
  }
  if (pthread_cond_init(&w->cv, NULL) != 0) {
    pthread_mutex_destroy(&w->mu);
    free(w);
    return;
  }
  if (pthread_create(&w->thread, NULL, watch_main, w) != 0) {
    GPUPOOL__WARN("cuda: cannot start the copy watcher thread; a host function after each copy tells of its end");
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
    return;
  }
  st->watch = w;
}

void gpupool__cuda_watch_stop(gpupool__cuda_state *st) {
  struct gpupool__cuda_watch *w = st->watch;
  if (!w)
    return;
  pthread_mutex_lock(&w->mu);
  w->stop = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->thread, NULL);
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  free(w);
  st->watch = NULL;
}

void gpupool__cuda_watch_add(gpupool__bcopy *c) {
  struct gpupool__cuda_watch *w = c->st->watch;
  pthread_mutex_lock(&w->mu);
  c->started_ns = mono_ns();
  c->wprev = NULL;
  c->wnext = w->head;
  if (w->head)
    w->head->wprev = c;
  w->head = c;
  c->watched = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* c leaves the watcher's list before its events go back to the idle pool. */
void gpupool__cuda_watch_remove(gpupool__bcopy *c) {
  struct gpupool__cuda_watch *w = c->st->watch;
  if (!w)
    return;
  pthread_mutex_lock(&w->mu);
  if (c->watched)
    watch_unlink(w, c);
  pthread_mutex_unlock(&w->mu);
}
