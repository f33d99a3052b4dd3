#include "dl_log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "strbuf.h"

static _Atomic int log_level = DL_LOG_INFO;
static _Atomic int log_json;

static const char *const level_names[] = {"error", "warn", "info", "debug"};

int dl_log_parse_level(const char *s, dl_log_level *out)
{
    for (int i = 0; i <= DL_LOG_DEBUG; i++) {
        if (strcmp(s, level_names[i]) == 0) {
            *out = (dl_log_level)i;
            return 0;
        }
    }
    return -1;
}

const char *dl_log_level_name(dl_log_level l)
{
    return (unsigned)l <= DL_LOG_DEBUG ? level_names[l] : "?";
}

void dl_log_set_level(dl_log_level l)
{
    atomic_store(&log_level, (int)l);
}

void dl_log_set_json(int json)
{
    atomic_store(&log_json, json);
}

int dl_log_enabled(dl_log_level l)
{
    return (int)l <= atomic_load(&log_level);
}

/* Whether a bare value reads as a JSON number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, the
 * whole of [s, s+len).  "nan", "inf", "007", "1." and "0x10" do not. */
static int is_json_number(const char *s, size_t len)
{
    size_t i = 0;

    if (i < len && s[i] == '-')
        i++;
    if (i >= len || s[i] < '0' || s[i] > '9')
        return 0;
    if (s[i] == '0')
        i++;
    else
        while (i < len && s[i] >= '0' && s[i] <= '9')
            i++;
    if (i < len && s[i] == '.') {
        size_t d = ++i;
        while (i < len && s[i] >= '0' && s[i] <= '9')
            i++;
        if (i == d)
            return 0;
    }
    if (i < len && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < len && (s[i] == '+' || s[i] == '-'))
            i++;
        size_t d = i;
        while (i < len && s[i] >= '0' && s[i] <= '9')
            i++;
        if (i == d)
            return 0;
    }
    return i == len;
}

static int is_json_bool(const char *s, size_t len)
{
    return (len == 4 && memcmp(s, "true", 4) == 0) || (len == 5 && memcmp(s, "false", 5) == 0);
}

const char *dl_log_q(char *buf, unsigned size, const char *s)
{
    /* a string that would read as a number or a boolean is quoted too, so the JSON log keeps it a
     * string (a node id "42" stays "42") */
    int plain = s[0] != '\0' && !is_json_number(s, strlen(s)) && !is_json_bool(s, strlen(s));
    size_t o = 0;

    for (const char *p = s; *p; p++) {
        if ((unsigned char)*p <= ' ' || *p == '"' || *p == '\\' || *p == '=' || *p == 0x7f)
            plain = 0;
    }
    if (plain) {
        snprintf(buf, size, "%s", s);
        return buf;
    }
    if (size < 3) {
        buf[0] = '\0';
        return buf;
    }
    buf[o++] = '"';
    for (const char *p = s; *p && o + 7 < size; p++) {
        unsigned char c = (unsigned char)*p;
        if (c == '"' || c == '\\') {
            buf[o++] = '\\';
            buf[o++] = (char)c;
        } else if (c < 0x20 || c == 0x7f) {
            o += (size_t)snprintf(buf + o, size - o, "\\u%04x", c);
        } else {
            buf[o++] = (char)c;
        }
    }
    buf[o++] = '"';
    buf[o] = '\0';
    return buf;
}

static void timestamp(char *out, size_t size)
{
    struct timespec ts;
    struct tm tm;

    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    snprintf(out, size, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
             tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000);
}

/* Converts "k=1 k2=\"a b\" k3=true k4=x" into JSON members ,"k":1,"k2":"a b","k3":true,"k4":"x".
 * A bare value that is a JSON number or true/false is written as one (what a printf %d, %g or a
 * literal true produced); a quoted value (dl_log_q) and every other bare value stay strings. */
static void fields_to_json(sbuf *b, const char *f)
{
    while (*f) {
        const char *k, *eq;
        while (*f == ' ')
            f++;
        if (*f == '\0')
            break;
        k = f;
        eq = strchr(k, '=');
        if (eq == NULL)
            break;
        sb_add(b, ",", 1);
        sb_json_string(b, k, (size_t)(eq - k));
        sb_add(b, ":", 1);
        f = eq + 1;
        if (*f == '"') {
            sbuf v = {0};
            f++;
            while (*f && *f != '"') {
                if (*f == '\\' && f[1] == 'u' && strlen(f) >= 6) {
                    unsigned c = 0;
                    sscanf(f + 2, "%4x", &c);
                    char ch = (char)c;
                    sb_add(&v, &ch, 1);
                    f += 6;
                    continue;
                }
                if (*f == '\\' && f[1])
                    f++;
                sb_add(&v, f, 1);
                f++;
            }
            if (*f == '"')
                f++;
            sb_json_string(b, v.p ? v.p : "", v.len);
            free(v.p);
        } else {
            const char *end = strchr(f, ' ');
            size_t len = end ? (size_t)(end - f) : strlen(f);
            if (is_json_number(f, len) || is_json_bool(f, len))
                sb_add(b, f, len);
            else
                sb_json_string(b, f, len);
            f += len;
        }
    }
}

void dl_log(dl_log_level l, const char *component, const char *msg, const char *fields, ...)
{
    char ts[96], fbuf[2048];
    va_list ap;
    sbuf b = {0};

    if (!dl_log_enabled(l))
        return;
    timestamp(ts, sizeof(ts));
    va_start(ap, fields);
    vsnprintf(fbuf, sizeof(fbuf), fields, ap);
    va_end(ap);
    if (atomic_load(&log_json)) {
        sb_str(&b, "{\"ts\":\"");
        sb_str(&b, ts);
        sb_str(&b, "\",\"level\":\"");
        sb_str(&b, level_names[l]);
        sb_str(&b, "\",\"component\":");
        sb_json_string(&b, component, strlen(component));
        sb_str(&b, ",\"msg\":");
        sb_json_string(&b, msg, strlen(msg));
        fields_to_json(&b, fbuf);
        sb_str(&b, "}\n");
    } else {
        char head[128];
        int n = snprintf(head, sizeof(head), "%s %-5s %s: ", ts, level_names[l], component);
        sb_add(&b, head, n > 0 ? (size_t)n : 0);
        sb_str(&b, msg);
        if (fbuf[0] != '\0') {
            sb_add(&b, " ", 1);
            sb_str(&b, fbuf);
        }
        sb_add(&b, "\n", 1);
    }
    if (!b.oom) {
        ssize_t w = write(STDERR_FILENO, b.p, b.len);
        (void)w;        /* nowhere to report a failed log write */
    }
    free(b.p);
}
