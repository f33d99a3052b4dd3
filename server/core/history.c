#include "history.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cJSON.h>

#include "fsutil.h"

#define HISTORY_FILE "rounds.jsonl"
#define MAX_NODES_PER_RECORD 65536

/* ---- one record as JSON ------------------------------------------------------------------------ */

static void add_num(sbuf *b, double v)
{
    char tmp[40];
    if (!isfinite(v)) {
        sb_str(b, "null");      /* JSON has no NaN */
        return;
    }
    snprintf(tmp, sizeof(tmp), "%.9g", v);
    sb_str(b, tmp);
}

/* A weight: every digit, so that an oracle recomputes the update's alpha from the record bit for bit. */
static void add_num17(sbuf *b, double v)
{
    char tmp[40];
    snprintf(tmp, sizeof(tmp), "%.17g", isfinite(v) ? v : 0.0);
    sb_str(b, tmp);
}

/* %.17g, or null for a figure not known (NaN) */
static void add_opt17(sbuf *b, double v)
{
    if (isfinite(v))
        add_num17(b, v);
    else
        sb_str(b, "null");
}

/* A reported metric: the fewest of 15, 16 or 17 significant digits that read back as the same double
 * (what the worker wrote, 2.4, stays 2.4; 17 digits always round-trip). */
static void add_exact(sbuf *b, double v)
{
    char tmp[40];
    for (int digits = 15; digits <= 17; digits++) {
        snprintf(tmp, sizeof(tmp), "%.*g", digits, v);
        if (strtod(tmp, NULL) == v)
            break;
    }
    sb_str(b, tmp);
}

/* A wall-clock time in Unix seconds to the millisecond, under key; nothing when not known (0). */
static void add_unix(sbuf *b, const char *key, double t)
{
    if (!(t > 0) || !isfinite(t))
        return;
    sb_printf(b, "%s%.3f", key, t);
}

static double get_unix(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) && isfinite(v->valuedouble) && v->valuedouble > 0 ? v->valuedouble : 0;
}

static void add_u64(sbuf *b, const char *key, uint64_t v)
{
    sb_str(b, key);
    sb_u64(b, v);
}

static void add_time(sbuf *b, time_t t)
{
    char when[48];
    struct tm tm;
    if (t == 0 || gmtime_r(&t, &tm) == NULL) {
        sb_str(b, "null");
        return;
    }
    strftime(when, sizeof(when), "\"%Y-%m-%dT%H:%M:%S+00:00\"", &tm);
    sb_str(b, when);
}

void history_metrics_json(sbuf *b, const delta_metrics *m)
{
    const char *sep = "{";

    if (m->have & DELTA_M_LOSS) {
        sb_printf(b, "%s\"loss\":", sep);
        add_exact(b, m->loss);
        sep = ",";
    }
    if (m->have & DELTA_M_NUM_TOKENS) {
        sb_printf(b, "%s\"num_tokens\":%" PRIu64, sep, m->num_tokens);
        sep = ",";
    }
    if (m->have & DELTA_M_INNER_STEPS) {
        sb_printf(b, "%s\"inner_steps\":%" PRIu64, sep, m->inner_steps);
        sep = ",";
    }
    if (m->have & DELTA_M_TOKENS_PER_SECOND) {
        sb_printf(b, "%s\"tokens_per_second\":", sep);
        add_exact(b, m->tokens_per_second);
        sep = ",";
    }
    if (m->have & DELTA_M_WEIGHT) {
        sb_printf(b, "%s\"weight\":", sep);
        add_exact(b, m->weight);
        sep = ",";
    }
    if (m->nnamed > 0) {
        sb_printf(b, "%s\"metric\":{", sep);
        for (size_t i = 0; i < m->nnamed; i++) {
            sb_printf(b, "%s\"%s\":", i ? "," : "", m->name[i]);   /* [A-Za-z0-9_]: nothing to escape */
            add_exact(b, m->value[i]);
        }
        sb_str(b, "}");
        sep = ",";
    }
    sb_str(b, sep[0] == '{' ? "{}" : "}");
}

/* A record's quarantined (or refused) deltas: opening text, then one object per delta. */
static void add_screened(sbuf *b, const char *open, const node_stat *list, size_t n)
{
    sb_str(b, open);
    for (size_t i = 0; i < n; i++) {
        const node_stat *q = &list[i];
        sb_str(b, i ? ",{\"node_id\":" : "{\"node_id\":");
        sb_json_string(b, q->node_id, strlen(q->node_id));
        add_u64(b, ",\"local_step\":", q->local_step);
        sb_str(b, strcmp(q->quarantine_reason, "cosine") == 0 ? ",\"cosine\":" : ",\"norm\":");
        add_opt17(b, q->norm);
        sb_str(b, ",\"bound\":");
        add_opt17(b, q->bound);
        sb_str(b, ",\"reason\":");
        sb_json_string(b, q->quarantine_reason, strlen(q->quarantine_reason));
        add_unix(b, ",\"received_unix\":", q->received_at);
        if (q->metrics.have != 0 || q->metrics.nnamed != 0) {
            sb_str(b, ",\"metrics\":");      /* what the worker reported, kept on the dashboard's plots */
            history_metrics_json(b, &q->metrics);
        }
        sb_str(b, "}");
    }
}

void history_record_json(sbuf *b, const round_record *r)
{
    add_u64(b, "{\"step\":", r->step);
    add_u64(b, ",\"outer_step\":", r->step + 1);
    sb_str(b, ",\"reason\":");
    sb_json_string(b, r->reason, strlen(r->reason));
    sb_str(b, ",\"closed_at\":");
    add_time(b, r->closed_at);
    add_unix(b, ",\"opened_unix\":", r->opened_at);
    add_unix(b, ",\"closed_unix\":", r->closed_wall);
    sb_str(b, ",\"seconds\":");
    add_num(b, r->seconds);
    sb_str(b, ",\"gbps\":");
    add_num(b, r->gbps);
    add_u64(b, ",\"bytes\":", r->bytes);
    sb_str(b, ",\"mean_norm\":");
    add_num(b, r->mean_norm);
    sb_str(b, ",\"nodes\":[");
    for (size_t i = 0; i < r->n; i++) {
        const node_stat *n = &r->nodes[i];
        sb_str(b, i ? ",{\"node_id\":" : "{\"node_id\":");
        sb_json_string(b, n->node_id, strlen(n->node_id));
        add_u64(b, ",\"local_step\":", n->local_step);
        add_u64(b, ",\"bytes\":", n->bytes);
        sb_str(b, ",\"norm\":");
        add_num(b, n->norm);
        sb_str(b, ",\"cosine\":");
        add_num(b, n->cosine);
        sb_str(b, ",\"intake_norm\":");
        add_opt17(b, n->intake_norm);
        sb_str(b, ",\"scale\":");
        add_opt17(b, n->scale);
        add_unix(b, ",\"received_unix\":", n->received_at);
        if (r->async) {
            add_u64(b, ",\"base_outer_step\":", n->base_outer_step);
            add_u64(b, ",\"tau\":", n->tau);
            sb_str(b, ",\"weight\":");
            add_num17(b, n->weight);
        }
        if (n->metrics.have != 0 || n->metrics.nnamed != 0) {
            sb_str(b, ",\"metrics\":");
            history_metrics_json(b, &n->metrics);
        }
        if (n->cz.enc != CZ_NONE)
            sb_printf(b, ",\"encoding\":\"%s\",\"block\":%u", cz_encoding_name(n->cz.enc), n->cz.block);
        sb_str(b, "}");
    }
    sb_str(b, "]");
    if (r->async) {
        sb_str(b, ",\"mode\":\"async\",\"weight\":");
        add_num17(b, r->weight);
        add_u64(b, ",\"dn_k\":", r->dn_k);
        add_u64(b, ",\"dn_period\":", r->dn_period);
        sb_str(b, r->dn_tick ? ",\"nesterov_step\":true" : ",\"nesterov_step\":false");
    }
    if (r->aggregate[0] != '\0') {
        sb_str(b, ",\"aggregate\":");
        sb_json_string(b, r->aggregate, strlen(r->aggregate));
    }
    add_screened(b, ",\"quarantined\":[", r->quarantined, r->nquarantined);
    if (r->nrefused > 0)
        add_screened(b, "],\"refused\":[", r->refused, r->nrefused);
    sb_str(b, "]}");
}

/* A JSON number that must be an exact non-negative integer (below 2^53, where doubles are exact). */
static int get_count(const cJSON *o, const char *key, uint64_t *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || v->valuedouble > 9007199254740991.0 ||
        v->valuedouble != floor(v->valuedouble))
        return -1;
    *out = (uint64_t)v->valuedouble;
    return 0;
}

static double get_double(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static void parse_metrics(const cJSON *o, delta_metrics *m);

/* The record's quarantined (or refused) deltas (history_record_json's "quarantined", "refused"), at most
 * MAX_NODES_PER_RECORD. */
static int parse_screened(const cJSON *o, const char *key, node_stat **out, size_t *nout)
{
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(o, key), *q;
    int count;

    if (!cJSON_IsArray(list) || (count = cJSON_GetArraySize(list)) == 0)
        return 0;
    if (count > MAX_NODES_PER_RECORD || (*out = calloc((size_t)count, sizeof(**out))) == NULL)
        return -1;
    cJSON_ArrayForEach(q, list) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(q, "node_id");
        const cJSON *why = cJSON_GetObjectItemCaseSensitive(q, "reason");
        node_stat *s = &(*out)[*nout];
        if (!cJSON_IsString(id) || !delta_valid_node_id(id->valuestring, strlen(id->valuestring)) ||
            !cJSON_IsString(why))
            continue;
        snprintf(s->node_id, sizeof(s->node_id), "%s", id->valuestring);
        snprintf(s->quarantine_reason, sizeof(s->quarantine_reason), "%s", why->valuestring);
        if (get_count(q, "local_step", &s->local_step) != 0)
            s->local_step = 0;
        s->norm = get_double(q, strcmp(s->quarantine_reason, "cosine") == 0 ? "cosine" : "norm");
        s->bound = get_double(q, "bound");
        s->received_at = get_unix(q, "received_unix");
        parse_metrics(cJSON_GetObjectItemCaseSensitive(q, "metrics"), &s->metrics);
        (*nout)++;
    }
    return 0;
}

/* The "metrics" object history_metrics_json writes; a member that breaks the delta rules is dropped. */
static void parse_metrics(const cJSON *o, delta_metrics *m)
{
    const cJSON *v, *named;
    double x;

    memset(m, 0, sizeof(*m));
    if (!cJSON_IsObject(o))
        return;
    if (isfinite(x = get_double(o, "loss"))) {
        m->loss = x;
        m->have |= DELTA_M_LOSS;
    }
    if (get_count(o, "num_tokens", &m->num_tokens) == 0)
        m->have |= DELTA_M_NUM_TOKENS;
    if (get_count(o, "inner_steps", &m->inner_steps) == 0)
        m->have |= DELTA_M_INNER_STEPS;
    if (isfinite(x = get_double(o, "tokens_per_second")) && x >= 0) {
        m->tokens_per_second = x;
        m->have |= DELTA_M_TOKENS_PER_SECOND;
    }
    if (isfinite(x = get_double(o, "weight")) && x > 0) {
        m->weight = x;
        m->have |= DELTA_M_WEIGHT;
    }
    named = cJSON_GetObjectItemCaseSensitive(o, "metric");
    if (!cJSON_IsObject(named))
        return;
    cJSON_ArrayForEach(v, named) {
        size_t len = v->string != NULL ? strlen(v->string) : 0;
        if (cJSON_IsNumber(v) && isfinite(v->valuedouble) && delta_valid_metric_name(v->string, len))
            (void)delta_metrics_add(m, v->string, len, v->valuedouble);   /* past the cap, or twice: dropped */
    }
}

/* A node's "encoding" and "block", kept only when they make a valid spec (a hand-edited record loses
 * them, not the round). */
static void parse_encoding(const cJSON *n, cz_spec *out)
{
    const cJSON *enc = cJSON_GetObjectItemCaseSensitive(n, "encoding");
    uint64_t block;
    cz_spec cz = {CZ_NONE, 0};

    *out = cz;
    if (!cJSON_IsString(enc) || cz_encoding_parse(enc->valuestring, strlen(enc->valuestring), &cz.enc) != 0 ||
        get_count(n, "block", &block) != 0 || block > CZ_BLOCK_MAX)
        return;
    cz.block = (uint32_t)block;
    if (cz_spec_valid(&cz))
        *out = cz;
}

int history_record_parse(round_record *r, const char *json)
{
    cJSON *o = cJSON_Parse(json);
    const cJSON *nodes, *reason, *closed, *n;
    struct tm tm;
    int count, rc = -1;

    memset(r, 0, sizeof(*r));
    if (!cJSON_IsObject(o) || get_count(o, "step", &r->step) != 0)
        goto out;
    nodes = cJSON_GetObjectItemCaseSensitive(o, "nodes");
    if (!cJSON_IsArray(nodes) || (count = cJSON_GetArraySize(nodes)) > MAX_NODES_PER_RECORD)
        goto out;
    reason = cJSON_GetObjectItemCaseSensitive(o, "reason");
    snprintf(r->reason, sizeof(r->reason), "%s", cJSON_IsString(reason) ? reason->valuestring : "");
    r->seconds = get_double(o, "seconds");
    r->gbps = get_double(o, "gbps");
    r->mean_norm = get_double(o, "mean_norm");
    if (get_count(o, "bytes", &r->bytes) != 0)
        r->bytes = 0;
    closed = cJSON_GetObjectItemCaseSensitive(o, "closed_at");
    memset(&tm, 0, sizeof(tm));
    if (cJSON_IsString(closed) && strptime(closed->valuestring, "%Y-%m-%dT%H:%M:%S", &tm) != NULL)
        r->closed_at = timegm(&tm);
    r->opened_at = get_unix(o, "opened_unix");
    r->closed_wall = get_unix(o, "closed_unix");
    if ((r->nodes = calloc((size_t)count + 1, sizeof(*r->nodes))) == NULL)
        goto out;
    cJSON_ArrayForEach(n, nodes) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(n, "node_id");
        node_stat *s = &r->nodes[r->n];
        if (!cJSON_IsString(id) || !delta_valid_node_id(id->valuestring, strlen(id->valuestring)))
            continue;
        snprintf(s->node_id, sizeof(s->node_id), "%s", id->valuestring);
        if (get_count(n, "local_step", &s->local_step) != 0)
            s->local_step = 0;
        if (get_count(n, "bytes", &s->bytes) != 0)
            s->bytes = 0;
        s->norm = get_double(n, "norm");
        s->cosine = get_double(n, "cosine");
        if (get_count(n, "base_outer_step", &s->base_outer_step) != 0)
            s->base_outer_step = 0;
        if (get_count(n, "tau", &s->tau) != 0)
            s->tau = 0;
        s->weight = get_double(n, "weight");
        s->intake_norm = get_double(n, "intake_norm");
        s->scale = get_double(n, "scale");
        s->received_at = get_unix(n, "received_unix");
        parse_metrics(cJSON_GetObjectItemCaseSensitive(n, "metrics"), &s->metrics);
        parse_encoding(n, &s->cz);
        r->n++;
    }
    const cJSON *rule = cJSON_GetObjectItemCaseSensitive(o, "aggregate");
    if (cJSON_IsString(rule))
        snprintf(r->aggregate, sizeof(r->aggregate), "%s", rule->valuestring);
    if (parse_screened(o, "quarantined", &r->quarantined, &r->nquarantined) != 0 ||
        parse_screened(o, "refused", &r->refused, &r->nrefused) != 0)
        goto out;
    const cJSON *mode = cJSON_GetObjectItemCaseSensitive(o, "mode");
    if (cJSON_IsString(mode) && strcmp(mode->valuestring, "async") == 0) {
        uint64_t k, per;
        r->async = 1;
        r->weight = get_double(o, "weight");
        r->dn_k = get_count(o, "dn_k", &k) == 0 && k < 1000000 ? (unsigned)k : 0;
        r->dn_period = get_count(o, "dn_period", &per) == 0 && per <= 1000000 ? (unsigned)per : 0;
        r->dn_tick = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "nesterov_step"));
    }
    rc = 0;
out:
    cJSON_Delete(o);
    if (rc != 0)
        history_record_free(r);
    return rc;
}

void history_record_free(round_record *r)
{
    free(r->nodes);
    r->nodes = NULL;
    r->n = 0;
    free(r->quarantined);
    r->quarantined = NULL;
    r->nquarantined = 0;
    free(r->refused);
    r->refused = NULL;
    r->nrefused = 0;
}

/* ---- the ring ---------------------------------------------------------------------------------- */

void history_push(history *h, round_record *r)
{
    if (h->n == HISTORY_MAX) {
        history_record_free(&h->rec[h->head]);
        h->head = (h->head + 1) % HISTORY_MAX;
        h->n--;
    }
    h->rec[(h->head + h->n) % HISTORY_MAX] = *r;
    h->n++;
    r->nodes = NULL;
    r->n = 0;
    r->quarantined = NULL;
    r->nquarantined = 0;
    r->refused = NULL;
    r->nrefused = 0;
}

size_t history_count(const history *h)
{
    return h->n;
}

const round_record *history_get(const history *h, size_t i)
{
    return i < h->n ? &h->rec[(h->head + i) % HISTORY_MAX] : NULL;
}

const round_record *history_last(const history *h)
{
    return h->n ? history_get(h, h->n - 1) : NULL;
}

void history_free(history *h)
{
    for (size_t i = 0; i < h->n; i++)
        history_record_free(&h->rec[(h->head + i) % HISTORY_MAX]);
    memset(h, 0, sizeof(*h));
}

/* ---- rounds.jsonl ------------------------------------------------------------------------------ */

static char *history_path(const char *state_dir)
{
    char *p = NULL;
    return asprintf(&p, "%s/" HISTORY_FILE, state_dir) < 0 ? NULL : p;
}

int history_append(const char *state_dir, const char *lines, dl_error *err)
{
    char *path = history_path(state_dir), *buf = NULL;
    size_t len = strlen(lines), n;
    int fd = -1, rc = 0;

    if (path == NULL || (buf = malloc(len + 1)) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    memcpy(buf, lines, len);
    n = len;
    if (n == 0 || buf[n - 1] != '\n')
        buf[n++] = '\n';
    /* one write(2) of the whole text: a kill cannot leave half of it (a power loss can; load trims it) */
    errno = 0;
    if ((fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) < 0 ||
        write(fd, buf, n) != (ssize_t)n || fdatasync(fd) != 0)
        rc = dl_fail_errno(err, errno ? errno : EIO, "appending to %s", path);
out:
    if (fd >= 0)
        close(fd);
    free(buf);
    free(path);
    return rc;
}

/* A torn last line (no newline: a power loss in the middle of an append) would glue the next record
 * to it and lose both: cut it off before anything is appended. */
static int trim_torn_tail(const char *path, FILE *f, dl_error *err)
{
    struct stat sb;
    char c;
    off_t end;

    if (fstat(fileno(f), &sb) != 0)
        return dl_fail_errno(err, errno, "stat %s", path);
    end = sb.st_size;
    while (end > 0) {
        if (pread(fileno(f), &c, 1, end - 1) != 1)
            return dl_fail_errno(err, errno ? errno : EIO, "reading %s", path);
        if (c == '\n')
            break;
        end--;
    }
    if (end != sb.st_size && truncate(path, end) != 0)
        return dl_fail_errno(err, errno, "trimming the torn last line of %s", path);
    return 0;
}

int history_load(history *h, const char *state_dir, uint64_t committed_step, const char *committed_round_json,
                 dl_error *err)
{
    return history_load_each(h, state_dir, committed_step, committed_round_json, NULL, NULL, err);
}

int history_load_each(history *h, const char *state_dir, uint64_t committed_step, const char *committed_round_json,
                      void (*each)(void *arg, const round_record *r), void *arg, dl_error *err)
{
    char *path = history_path(state_dir), *line = NULL;
    size_t cap = 0;
    FILE *f = NULL;
    int rc = 0, have_committed = 0;
    round_record r;

    if (path == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    f = fopen(path, "re");
    if (f == NULL && errno != ENOENT) {
        rc = dl_fail_errno(err, errno, "opening %s", path);
        goto out;
    }
    if (f != NULL && (rc = trim_torn_tail(path, f, err)) != 0)
        goto out;
    while (f != NULL && getline(&line, &cap, f) > 0) {
        const round_record *last = history_last(h);
        /* damaged lines are skipped; a step at or past the committed one was never committed (a
         * state restored from an older backup); a repeated step was appended twice: keep the first */
        if (history_record_parse(&r, line) != 0)
            continue;
        if ((committed_step != UINT64_MAX && r.step >= committed_step) || (last != NULL && r.step <= last->step)) {
            history_record_free(&r);
            continue;
        }
        if (committed_step != UINT64_MAX && r.step + 1 == committed_step)
            have_committed = 1;
        if (each != NULL)
            each(arg, &r);
        history_push(h, &r);
    }
    if (committed_round_json != NULL && !have_committed && history_record_parse(&r, committed_round_json) == 0) {
        const round_record *last = history_last(h);
        if (r.step + 1 == committed_step && (last == NULL || r.step > last->step)) {
            /* committed, but the append after the commit did not happen: replay it */
            if ((rc = history_append(state_dir, committed_round_json, err)) != 0) {
                history_record_free(&r);
                goto out;
            }
            if (each != NULL)
                each(arg, &r);
            history_push(h, &r);
        } else {
            history_record_free(&r);
        }
    }
out:
    if (f != NULL)
        fclose(f);
    free(line);
    free(path);
    return rc;
}

/* Keeps rounds.jsonl from growing without end: past 2 x keep records, the file is rewritten with the
 * last keep (streamed through a temporary file, atomically replaced: a crash leaves the old or the new
 * file, never a mix).  0 when nothing was to do or the file is compacted. */
int history_compact(const char *state_dir, size_t keep, dl_error *err)
{
    char *path = history_path(state_dir), *line = NULL, *tmp = NULL;
    size_t cap = 0, lines = 0;
    FILE *f = NULL;
    int fd = -1, rc = 0;
    uint64_t off = 0;

    if (path == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if ((f = fopen(path, "re")) == NULL) {
        rc = errno == ENOENT ? 0 : dl_fail_errno(err, errno, "opening %s", path);
        goto out;
    }
    while (getline(&line, &cap, f) > 0)
        lines++;
    if (lines <= 2 * keep)
        goto out;
    rewind(f);
    for (size_t skip = lines - keep; skip > 0 && getline(&line, &cap, f) > 0; skip--)
        ;
    if ((rc = fsu_tmp_create(path, &tmp, &fd, err)) != 0)
        goto out;
    ssize_t n;
    while ((n = getline(&line, &cap, f)) > 0) {
        if ((rc = fsu_pwrite_all(fd, line, (size_t)n, off)) != 0) {
            rc = dl_fail_errno(err, -rc, "writing %s", tmp);
            close(fd);
            unlink(tmp);
            goto out;
        }
        off += (uint64_t)n;
    }
    rc = fsu_commit_tmp(fd, tmp, path, err);
out:
    if (f != NULL)
        fclose(f);
    free(line);
    free(tmp);
    free(path);
    return rc;
}
