/*
 * The peers' data plane (peers_ucx.c): one UCX ucp context and worker, driven from the
 * daemon's libuv loop (the worker's event fd in a uv_poll, ucp_worker_arm, a bounded number of
 * progress calls per loop turn), registrations of the memory ranges sent from, endpoints to
 * other daemons' workers, and the data itself as active messages that the serving daemon
 * sends (eager only: the receiving side of an eager message sends nothing back, so a daemon
 * never has UCX send on behalf of a peer that may be gone; UCX 1.13 aborts the process when
 * such a send fails, which its software RMA over TCP does for gets). peers.c is its only
 * user. Compiled only when UCX is found (GPUPOOL_HAVE_UCX).
 */
#ifndef GPUPOOL_DAEMON_PEERS_UCX_H
#define GPUPOOL_DAEMON_PEERS_UCX_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

typedef struct gpd_ucx gpd_ucx;
typedef struct gpd_ucx_reg gpd_ucx_reg;
typedef struct gpd_ucx_ep gpd_ucx_ep;

/* An operation finished: status 0, or a GPUPOOL_E* code (its message in gpupool__errmsg()).
 * Called from the loop after the progress calls, never from inside UCX. */
typedef void (*gpd_ucx_done)(void *arg, int status);
/* A data message arrived (called inside UCX's progress: copy it, free nothing, close nothing). */
typedef void (*gpd_ucx_recv)(void *arg, const void *header, size_t hlen, const void *data, size_t len);

/* The context and worker on loop, data messages going to recv(arg, ...); logs the transports
 * and how device memory would move. 0 or an error with the reason. */
int gpd_ucx_open(uv_loop_t *loop, gpd_ucx_recv recv, void *arg, gpd_ucx **out);
/* Progress until nothing is left to do (bounded), handing out what completed: after closing
 * the endpoints at shutdown, so that their gets end before their memory goes. */
void gpd_ucx_flush(gpd_ucx *u);
/* Closes the worker and context (every registration first). Gets that never completed are
 * dropped without their callbacks. */
void gpd_ucx_close(gpd_ucx *u);
/* The worker's address (owned by u), to hand to peers. */
void gpd_ucx_address(gpd_ucx *u, const void **addr, size_t *len);
/* 1 when this UCX can move CUDA memory itself (its memory types include CUDA). */
int gpd_ucx_moves_cuda(gpd_ucx *u);
/* "ucx 1.13.1 (tcp, ...)" for logs and gpupoolctl. */
const char *gpd_ucx_describe(gpd_ucx *u);

/* Register [addr, addr + len) (host memory the daemon maps). */
int gpd_ucx_reg_new(gpd_ucx *u, void *addr, size_t len, gpd_ucx_reg **out);
void gpd_ucx_reg_free(gpd_ucx_reg *r);

/* An endpoint to the worker at addr. */
int gpd_ucx_ep_new(gpd_ucx *u, const void *addr, size_t len, gpd_ucx_ep **out);
/* The transports the endpoint sends the data with, as UCX chose them once connected: its lanes
 * for active messages, as ucp_ep_print_info lists them ("tcp/eth0 (am, am_bw)"); empty when
 * UCX says nothing. */
void gpd_ucx_ep_describe(gpd_ucx_ep *ep, char *buf, size_t len);
/* Run the endpoint's wireup now: done is called once it is connected both ways (the peer's
 * reply arrived), or failed. */
int gpd_ucx_ep_connect(gpd_ucx_ep *ep, gpd_ucx_done done, void *arg);
/* Close it: gets still running on it end with an error (their callbacks still come, later,
 * from the loop); ep is freed once they have. */
void gpd_ucx_ep_close(gpd_ucx_ep *ep);

/* Send a data message: header (at most 32 bytes, copied) and len bytes at data (inside reg,
 * which may be NULL), which must stay valid until done is called: exactly once, also when the
 * endpoint is closed first. */
int gpd_ucx_send(gpd_ucx_ep *ep, const void *header, size_t hlen, const void *data, size_t len, gpd_ucx_reg *reg,
                 gpd_ucx_done done, void *arg);
/* Call done(arg, 0) from the loop after the current progress calls. */
int gpd_ucx_defer(gpd_ucx *u, gpd_ucx_done done, void *arg);

#endif
