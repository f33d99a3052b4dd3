/* dl_log: one line per event, "TIMESTAMP LEVEL component: message key=value ...", or one JSON object
 * per line.  Thread-safe: each line is formatted in full and written with a single write(2). */
#ifndef DL_LOG_H
#define DL_LOG_H

typedef enum dl_log_level { DL_LOG_ERROR, DL_LOG_WARN, DL_LOG_INFO, DL_LOG_DEBUG } dl_log_level;

/* Parses "error", "warn", "info", "debug"; returns 0 or -1. */
int dl_log_parse_level(const char *s, dl_log_level *out);
const char *dl_log_level_name(dl_log_level l);
void dl_log_set_level(dl_log_level l);
/* json != 0: {"ts":...,"level":...,"component":...,"msg":...,<fields>} per line. */
void dl_log_set_json(int json);
int dl_log_enabled(dl_log_level l);

/* fields is a printf format producing "key=value key=value"; a value holding spaces, quotes or
 * control characters must be written with dl_log_q(), and so must any string that may look like a
 * number or a boolean (a node id, a file name): in JSON a bare number or true/false becomes a JSON
 * number or boolean, everything else a string.  Example:
 *   dl_log(DL_LOG_INFO, "round", "closed", "step=%llu nodes=%zu reason=%s", step, n, reason); */
void dl_log(dl_log_level l, const char *component, const char *msg, const char *fields, ...)
    __attribute__((format(printf, 4, 5)));

/* Quotes s for a field value when needed ("a b" -> "\"a b\"", "42" -> "\"42\""), into buf; returns buf. */
const char *dl_log_q(char *buf, unsigned size, const char *s);

#endif
