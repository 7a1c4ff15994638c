/*
 * gpupoold --supervise (supervise.c): a parent that keeps the daemon's fd store and starts the
 * daemon again when it crashes, for containers and machines without systemd.
 */
#ifndef GPUPOOL_DAEMON_SUPERVISE_H
#define GPUPOOL_DAEMON_SUPERVISE_H

/* Run the daemon (this executable, with argv less --supervise) as a child until it stops;
 * returns the exit status for the supervisor. */
int gpd_supervise(int argc, char **argv);

#endif
