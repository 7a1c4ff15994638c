/*
 * libgpupool-client test hooks: points where a test may stop a thread of the client to play
 * a race out in a fixed order. Internal: not installed, and hidden in the shared library, so
 * a test that sets one links the static library (gpupool-client-static). Each is NULL unless
 * a test sets it, before the threads it watches start.
 */
#ifndef GPUPOOL_CLIENT_TEST_HOOKS_H
#define GPUPOOL_CLIENT_TEST_HOOKS_H

#include "gpupool/gpupool.h"
#include "wire.h"

/* Called by the thread whose request req just went out, before it waits for the reply
 * (call_fds in conn.c), with the client's lock released: where a real thread may
 * sleep for as long as another thread reads the socket, or the connection breaks and another
 * thread reconnects. */
extern void (*gpupool__hook_sent)(gpupool_client *c, const gpupool__req *req);

/* Called by a share that does not wait (gpupool_buffer_share_kept_many_nowait) once its n
 * tokens are made and before its request goes out, with the client's lock released: where a
 * test hands the tokens on first, so that their Open reaches the daemon before the share. One
 * thread only: another thread's share could go out meanwhile, out of the ids' order. */
extern void (*gpupool__hook_nowait)(gpupool_client *c, const gpupool_token *out, int n);

#endif
