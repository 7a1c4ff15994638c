/*
 * Set-up shared by the fuzz targets that drive the daemon's own code (fuzz_daemon,
 * fuzz_meta): host pools from pool specs and an opened host backend. In its own file, apart
 * from fuzz_common.c, since fuzz_client links the public library alone.
 */
#ifndef GPUPOOL_TESTS_FUZZ_POOLS_H
#define GPUPOOL_TESTS_FUZZ_POOLS_H

#include "backend.h"
#include "config.h"

/* Quiets the daemon's log unless GPUPOOL_FUZZ_LOG is set, adds each pool spec of the
 * NULL-terminated specs to cfg (already given its defaults and any limits), finishes it for
 * the host backend and opens that backend into *be. Any failure is fatal (fuzz_fail). */
void fuzz_host_pools(gpd_config *cfg, const char *const *specs, gpupool__backend **be);

#endif
