/*
 * What the table of keys (config.c) gives the files that read a configuration
 * (config_load.c) and reload one (config_reload.c).
 */
#ifndef GPUPOOL_DAEMON_CONFIG_INTERNAL_H
#define GPUPOOL_DAEMON_CONFIG_INTERNAL_H

#include <stddef.h>

/* Key k of section (a GPUPOOL__CS_* bit) into obj; refused as "unknown NOUN 'k'IN" when the
 * section has no such key (or only its section reader takes it, as share). */
int gpd_config_set_key(void *obj, unsigned section, const char *k, const char *v, const char *noun,
                       const char *in);
/* s into dst of len bytes, or GPUPOOL_EINVAL when it does not fit. */
int gpd_config_copy_str(char *dst, size_t len, const char *s);

#endif
