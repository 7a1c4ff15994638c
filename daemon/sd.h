/*
 * systemd integration without libsystemd: socket activation (LISTEN_FDS), readiness and
 * status (NOTIFY_SOCKET), and the watchdog (WATCHDOG_USEC). Each function is a no-op when
 * the daemon was not started by systemd.
 */
#ifndef GPUPOOL_DAEMON_SD_H
#define GPUPOOL_DAEMON_SD_H

#include <stdint.h>

/* The listening socket systemd passed (LISTEN_PID == getpid(), LISTEN_FDS == 1, fd 3), made
 * close-on-exec and nonblocking; -1 when not socket-activated; GPUPOOL_ECONFIG (message says
 * why) when LISTEN_FDS is set but unusable (several fds, not a listening Unix stream socket).
 * Unsets LISTEN_PID/LISTEN_FDS/LISTEN_FDNAMES either way. */
int gpd_sd_listen_fd(void);

/* Send a state string ("READY=1\nSTATUS=...") to $NOTIFY_SOCKET (path or abstract "@name").
 * 0 when sent or when NOTIFY_SOCKET is unset; GPUPOOL_EIO otherwise. */
int gpd_sd_notify(const char *state);
int gpd_sd_notifyf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Watchdog interval in microseconds (WATCHDOG_USEC, honouring WATCHDOG_PID), 0 if none. The
 * daemon pings "WATCHDOG=1" every half interval from its loop. */
uint64_t gpd_sd_watchdog_usec(void);

#endif
