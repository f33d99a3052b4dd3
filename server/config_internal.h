/* config_internal.h: what config.c (the options, their sources, config_load), config_check.c (validation) and
 * config_print.c (the effective configuration) share, for those files only. */
#ifndef CONFIG_INTERNAL_H
#define CONFIG_INTERNAL_H

#include <stddef.h>

#include "config.h"
#include "hub.h"

/* T_STR must not be empty; T_OPTSTR may be unset, and an empty value unsets it (a flag can so
 * cancel a file's path: --token-file '') */
typedef enum opt_type { T_STR, T_OPTSTR, T_UINT, T_DOUBLE, T_OPTIMIZER, T_NODES, T_LOGLEVEL, T_LOGFORMAT, T_SIZE, T_MODE, T_WEIGHT, T_BOUND, T_VARIANT, T_RULE, T_SCREEN, T_DOWNLINK } opt_type;

typedef struct opt {
    const char *key;            /* file key; the flag is "--" + key with '_' -> '-' */
    opt_type type;
    size_t offset;
    double min, max;            /* numeric range */
    const char *help;
} opt;

typedef struct slot {
    size_t index;               /* its place, into c->origin */
    const char *key;
    const opt *own;             /* config's own option, or NULL: the transport's */
    size_t transport;           /* the transport's row in the scheme table */
    const hub_option *hopt;
} slot;

/* Places (config.c, "options by place"): config's own options first, then each transport's. */
size_t config__nown(void);
int config__slot_at(size_t i, slot *s);
int config__find_key(const char *key, size_t len, slot *s);
const hub_option *config__transport_option(size_t t, const char *key);
size_t config__transport_of(const char *url);

/* A refusal on stderr, naming the option as it was given; 2. */
int config__bad(const char *origin, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int config__bad_opt(const config *c, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* config_modes.c: the table of what combines.  The first refused combination of c on stderr (2), or 0. */
int config__check_combinations(const config *c);
/* Warns about each option set (not to its default: defaults) that c's mode does not read. */
void config__warn_ignored_rows(const config *c, const config *defaults);
/* Warns that option s, set in c, is read only with needs. */
void config__warn_ignored(const config *c, const slot *s, const char *needs);

/* config_check.c */
int config__validate(config *c);
int config__state_committed(const config *c);

#endif
