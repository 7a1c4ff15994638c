/*
 * systemd integration without libsystemd: socket activation (LISTEN_FDS), readiness and
 * status (NOTIFY_SOCKET), and the watchdog (WATCHDOG_USEC). Each function is a no-op when
 * the daemon was not started by systemd.
 */
#ifndef GPUPOOL_DAEMON_SD_H
#define GPUPOOL_DAEMON_SD_H

#include <stddef.h>
#include <stdint.h>

/* The listening socket systemd passed (LISTEN_PID == getpid(), LISTEN_FDS == 1, fd 3), made
 * close-on-exec and nonblocking; -1 when not socket-activated; GPUPOOL_ECONFIG (message says
 * why) when LISTEN_FDS is set but unusable (several fds, not a listening Unix stream socket).
 * Unsets LISTEN_PID/LISTEN_FDS/LISTEN_FDNAMES either way. */
int gpd_sd_listen_fd(void);

/* Send a state string ("READY=1\nSTATUS=...") to $NOTIFY_SOCKET (path or abstract "@name").
 * 0 when sent or when NOTIFY_SOCKET is unset; GPUPOOL_EIO otherwise. */
int gpd_sd_notify(const char *state);
/* The same with fd passed along (SCM_RIGHTS; -1: none): "FDSTORE=1\nFDNAME=..." puts a copy
 * of it in the manager's fd store (sd_pid_notify_with_fds(3)). */
int gpd_sd_notify_fd(const char *state, int fd);

/* The fd store: entries whose FDNAME starts with the prefix are the daemon's own, given back
 * at the next start with LISTEN_FDS/LISTEN_FDNAMES next to (or without) the listening socket.
 * gpd_sd_listen_fd sets them aside; gpd_sd_stored_fds lists them (state.c takes them). */
#define GPD_SD_STORE_PREFIX "gpd."
#define GPD_SD_STORE_MAX 16384
typedef struct {
  char name[64];
  int fd; /* -1 once taken */
  int dropped; /* closed as unused (state.c) rather than taken */
} gpd_sd_stored;
gpd_sd_stored *gpd_sd_stored_fds(int *n);
int gpd_sd_notifyf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The most STATUS= text the daemon sends, NUL included: a line an operator reads in
 * `systemctl status`, well inside one notify datagram. */
#define GPD_SD_STATUS_MAX 1024

/* Copy text into buf (cap bytes, NUL included): whole when it fits, otherwise cut at the
 * last space that leaves room for " ..." (the mark of a cut), never inside a word; a text
 * without such a space is cut at a UTF-8 character boundary (systemd drops a STATUS= that
 * is not valid UTF-8). Returns the length written. */
size_t gpd_sd_fit(char *buf, size_t cap, const char *text);

/* Append sep and then text to the status being built in buf (len bytes used of cap),
 * keeping `keep` bytes free for the parts that come after it; text is cut as by gpd_sd_fit
 * when it does not fit, and nothing is appended when not even a short word would. Returns
 * the new length. Build a status with its most important part first. */
size_t gpd_sd_status_add(char *buf, size_t cap, size_t len, const char *sep, const char *text, size_t keep);

/* Watchdog interval in microseconds (WATCHDOG_USEC, honouring WATCHDOG_PID), 0 if none. The
 * daemon pings "WATCHDOG=1" every half interval from its loop. */
uint64_t gpd_sd_watchdog_usec(void);

#endif
