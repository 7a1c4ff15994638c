/*
 * Raw frames onto the daemon's socket, for the tests that play a client the library would
 * never be (hostile, flooding or half-broken ones): the th_raw_* names of
 * tests/support/frames.h. No cmocka assertions here: children use these too.
 */
#ifndef GPUPOOL_TEST_RAW_H
#define GPUPOOL_TEST_RAW_H

#include "frames.h"

#define th_raw_connect ts_raw_connect
#define th_raw_send ts_raw_send
#define th_raw_send_stats ts_raw_send_stats
#define th_raw_recv ts_raw_recv

#endif
