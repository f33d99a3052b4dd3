#include "verdicts.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

const char *const verdict_kind_names[VERDICT__COUNT] = {
    [VERDICT_ACCEPTED] = "accepted",       [VERDICT_QUEUED] = "queued",     [VERDICT_AGGREGATED] = "aggregated",
    [VERDICT_QUARANTINED] = "quarantined", [VERDICT_REPLACED] = "replaced", [VERDICT_REFUSED] = "refused",
};

_Static_assert(COUNT_OF(verdict_kind_names) == VERDICT__COUNT, "a verdict without a name");

#define STEP_MAX 9007199254740991.0     /* 2^53 - 1: what a JSON number holds exactly */

int verdicts_init(verdicts *v)
{
    memset(v, 0, sizeof(*v));
    if ((v->nodes = calloc(VERDICTS_NODES_MAX, sizeof(*v->nodes))) == NULL)
        return -DL_E_NO_MEMORY;
    return 0;
}

void verdicts_free(verdicts *v)
{
    free(v->nodes);
    memset(v, 0, sizeof(*v));
}

static int reason_valid(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > VERDICT_REASON_MAX)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '_'))
            return 0;
    return 1;
}

/* A message as the records keep it: printable ASCII only (a tensor name from a hostile header may hold
 * any bytes, and the document must stay valid UTF-8 JSON), cut to VERDICT_MESSAGE_MAX. */
static void copy_message(char *out, const char *msg)
{
    size_t i = 0;
    for (; msg != NULL && msg[i] != '\0' && i < VERDICT_MESSAGE_MAX; i++)
        out[i] = (unsigned char)msg[i] >= 0x20 && (unsigned char)msg[i] < 0x7f ? msg[i] : '?';
    out[i] = '\0';
}

static verdict_node *find(const verdicts *v, const char *node_id)
{
    for (size_t i = 0; i < v->n; i++)
        if (strcmp(v->nodes[i].node_id, node_id) == 0)
            return &v->nodes[i];
    return NULL;
}

const verdict_node *verdicts_find(const verdicts *v, const char *node_id)
{
    return find(v, node_id);
}

/* node_id's entry, made when missing (the node seen longest ago forgotten when the table is full). */
static verdict_node *node_for(verdicts *v, const char *node_id)
{
    verdict_node *e = find(v, node_id);

    if (e != NULL)
        return e;
    if (v->n == VERDICTS_NODES_MAX) {
        size_t old = 0;
        for (size_t i = 1; i < v->n; i++)
            if (v->nodes[i].seen < v->nodes[old].seen)
                old = i;
        v->nodes[old] = v->nodes[--v->n];
        v->dropped_nodes++;
    }
    e = &v->nodes[v->n++];
    memset(e, 0, sizeof(*e));
    snprintf(e->node_id, sizeof(e->node_id), "%s", node_id);
    return e;
}

/* reason's count, made when new; a reason past the node's first VERDICT_REASONS_MAX - 1 counts as
 * "other" (the last slot), so that the counts still add up to total. */
static verdict_count *slot(verdict_node *e, const char *reason)
{
    for (size_t i = 0; i < e->ncounts; i++)
        if (strcmp(e->counts[i].reason, reason) == 0)
            return &e->counts[i];
    if (e->ncounts >= VERDICT_REASONS_MAX - 1 && strcmp(reason, "other") != 0)
        return slot(e, "other");
    if (e->ncounts == VERDICT_REASONS_MAX)
        return &e->counts[VERDICT_REASONS_MAX - 1];     /* a file's 24 reasons: no "other" among them */
    snprintf(e->counts[e->ncounts].reason, sizeof(e->counts[0].reason), "%s", reason);
    e->counts[e->ncounts].n = 0;
    return &e->counts[e->ncounts++];
}

static void count(verdict_node *e, const char *reason)
{
    slot(e, reason)->n++;
    e->total++;
}

static void fill(verdict_record *r, const verdict_delta *dlt, verdict_kind kind, const char *reason, int status,
                 const char *message, double at)
{
    r->kind = kind;
    snprintf(r->reason, sizeof(r->reason), "%s", reason);
    r->status = status;
    r->has_steps = dlt->has_steps;
    r->local_step = dlt->has_steps ? dlt->local_step : 0;
    r->base_outer_step = dlt->has_steps ? dlt->base_outer_step : 0;
    r->step = dlt->step;
    r->at = at;
    copy_message(r->message, message);
}

static const char *reason_of(verdict_kind kind, const char *reason)
{
    /* a reason we did not make up ourselves never reaches the records as it is */
    return reason != NULL && reason_valid(reason) ? reason : verdict_kind_names[kind];
}

void verdicts_arrive(verdicts *v, const verdict_delta *dlt, verdict_kind kind, const char *reason, int status,
                     const char *message, double at)
{
    verdict_node *e;

    if ((unsigned)kind >= VERDICT__COUNT || !delta_valid_node_id(dlt->node_id, strlen(dlt->node_id)))
        return;
    e = node_for(v, dlt->node_id);
    reason = reason_of(kind, reason);
    if (e->n == VERDICTS_PER_NODE)
        e->head = (e->head + 1) % VERDICTS_PER_NODE;
    else
        e->n++;
    fill(&e->ring[(e->head + e->n - 1) % VERDICTS_PER_NODE], dlt, kind, reason, status, message, at);
    count(e, reason);
    e->seen = ++v->clock;
    v->changes++;
}

/* The delta's newest record still waiting for its verdict (accepted or queued), or NULL: a retry of
 * the same delta refused not_newer in between does not hide it. */
static verdict_record *pending_of(const verdict_node *e, const verdict_delta *dlt)
{
    for (size_t i = e != NULL ? e->n : 0; i > 0; i--) {
        const verdict_record *r = &e->ring[(e->head + i - 1) % VERDICTS_PER_NODE];
        if (r->has_steps && r->local_step == dlt->local_step && r->base_outer_step == dlt->base_outer_step &&
            (r->kind == VERDICT_ACCEPTED || r->kind == VERDICT_QUEUED))
            return (verdict_record *)r;
    }
    return NULL;
}

int verdicts_pending(const verdicts *v, const verdict_delta *dlt)
{
    return pending_of(find(v, dlt->node_id), dlt) != NULL;
}

int verdicts_settle(verdicts *v, const verdict_delta *dlt, verdict_kind kind, const char *reason,
                    const char *message, double at, int only_pending)
{
    verdict_node *e = find(v, dlt->node_id);
    verdict_record *r = pending_of(e, dlt);

    if ((unsigned)kind >= VERDICT__COUNT)
        return 0;
    /* only a record still waiting for its verdict takes it: a decided one stays as it was */
    if (r != NULL) {
        int status = r->status;
        reason = reason_of(kind, reason);
        fill(r, dlt, kind, reason, status, message, at);
        count(e, reason);
        e->seen = ++v->clock;
        v->changes++;
        return 1;
    }
    if (only_pending)
        return 0;
    verdicts_arrive(v, dlt, kind, reason, 0, message, at);
    return 1;
}

uint64_t verdicts_count(const verdicts *v, const char *node_id, const char *reason)
{
    const verdict_node *e = find(v, node_id);
    for (size_t i = 0; e != NULL && i < e->ncounts; i++)
        if (strcmp(e->counts[i].reason, reason) == 0)
            return e->counts[i].n;
    return 0;
}

/* ---- JSON ---------------------------------------------------------------------------------------- */

static void record_json(const verdict_record *r, sbuf *b)
{
    sb_printf(b, "{\"verdict\":\"%s\",\"reason\":\"%s\",\"status\":", verdict_kind_names[r->kind], r->reason);
    if (r->status > 0)
        sb_printf(b, "%d", r->status);
    else
        sb_str(b, "null");
    if (r->has_steps)
        sb_printf(b, ",\"local_step\":%" PRIu64 ",\"base_outer_step\":%" PRIu64, r->local_step, r->base_outer_step);
    else
        sb_str(b, ",\"local_step\":null,\"base_outer_step\":null");
    sb_printf(b, ",\"step\":%" PRIu64 ",\"time\":%.3f,\"message\":", r->step, r->at);
    sb_json_string(b, r->message, strlen(r->message));
    sb_str(b, "}");
}

void verdicts_node_json(const verdict_node *e, sbuf *b)
{
    sb_str(b, "{\"node_id\":");
    sb_json_string(b, e->node_id, strlen(e->node_id));
    sb_printf(b, ",\"total\":%" PRIu64 ",\"counts\":{", e->total);
    for (size_t i = 0; i < e->ncounts; i++)
        sb_printf(b, "%s\"%s\":%" PRIu64, i ? "," : "", e->counts[i].reason, e->counts[i].n);
    sb_str(b, "},\"deltas\":[");
    for (size_t i = e->n; i > 0; i--) {
        if (i != e->n)
            sb_str(b, ",");
        record_json(&e->ring[(e->head + i - 1) % VERDICTS_PER_NODE], b);
    }
    sb_str(b, "]}");
}

void verdicts_json(const verdicts *v, sbuf *b)
{
    sb_printf(b, "{\"version\":1,\"dropped_nodes\":%" PRIu64 ",\"nodes\":[", v->dropped_nodes);
    for (size_t i = 0; i < v->n; i++) {
        if (i > 0)
            sb_str(b, ",\n");
        verdicts_node_json(&v->nodes[i], b);
    }
    sb_str(b, "]}\n");
}

/* ---- the file, read back: every field checked ----------------------------------------------------- */

static int u64_of(const cJSON *o, uint64_t *out)
{
    if (!cJSON_IsNumber(o) || !(o->valuedouble >= 0) || o->valuedouble > STEP_MAX ||
        o->valuedouble != floor(o->valuedouble))
        return -1;
    *out = (uint64_t)o->valuedouble;
    return 0;
}

static int string_of(const cJSON *o, char *out, size_t size)
{
    if (!cJSON_IsString(o) || o->valuestring == NULL || strlen(o->valuestring) >= size)
        return -1;
    snprintf(out, size, "%s", o->valuestring);
    return 0;
}

static int kind_of(const char *name, verdict_kind *k)
{
    for (int i = 0; i < VERDICT__COUNT; i++)
        if (strcmp(name, verdict_kind_names[i]) == 0) {
            *k = (verdict_kind)i;
            return 0;
        }
    return -1;
}

static int parse_record(const cJSON *o, verdict_record *r)
{
    char kind[16];
    const cJSON *ls = cJSON_GetObjectItemCaseSensitive(o, "local_step");
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(o, "base_outer_step");
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "status");
    const cJSON *at = cJSON_GetObjectItemCaseSensitive(o, "time");
    uint64_t status = 0;

    if (!cJSON_IsObject(o) || string_of(cJSON_GetObjectItemCaseSensitive(o, "verdict"), kind, sizeof(kind)) != 0 ||
        kind_of(kind, &r->kind) != 0 ||
        string_of(cJSON_GetObjectItemCaseSensitive(o, "reason"), r->reason, sizeof(r->reason)) != 0 ||
        !reason_valid(r->reason) || string_of(cJSON_GetObjectItemCaseSensitive(o, "message"), r->message,
                                               sizeof(r->message)) != 0 ||
        u64_of(cJSON_GetObjectItemCaseSensitive(o, "step"), &r->step) != 0 || !cJSON_IsNumber(at) ||
        !(at->valuedouble >= 0 && at->valuedouble < 1e11))
        return -1;
    if (!cJSON_IsNull(st) && (u64_of(st, &status) != 0 || status < 100 || status > 599))
        return -1;
    r->status = (int)status;
    r->at = at->valuedouble;
    if (cJSON_IsNull(ls) && cJSON_IsNull(bs)) {
        r->has_steps = 0;
    } else {
        if (u64_of(ls, &r->local_step) != 0 || u64_of(bs, &r->base_outer_step) != 0)
            return -1;
        r->has_steps = 1;
    }
    for (const char *p = r->message; *p; p++)
        if ((unsigned char)*p < 0x20 || (unsigned char)*p >= 0x7f)
            return -1;
    return 0;
}

static int parse_node(verdicts *v, const cJSON *o, const char **why)
{
    verdict_node *e;
    const cJSON *counts = cJSON_GetObjectItemCaseSensitive(o, "counts");
    const cJSON *deltas = cJSON_GetObjectItemCaseSensitive(o, "deltas");
    const cJSON *it;
    char id[DELTA_NODE_ID_MAX + 1];
    uint64_t total = 0, sum = 0;
    int nd;

    *why = "a node is not an object with node_id, total, counts and deltas";
    if (!cJSON_IsObject(o) || string_of(cJSON_GetObjectItemCaseSensitive(o, "node_id"), id, sizeof(id)) != 0 ||
        u64_of(cJSON_GetObjectItemCaseSensitive(o, "total"), &total) != 0 || !cJSON_IsObject(counts) ||
        !cJSON_IsArray(deltas))
        return -1;
    *why = "a node id is not [A-Za-z0-9._-]{1,64}, or appears twice";
    if (!delta_valid_node_id(id, strlen(id)) || find(v, id) != NULL)
        return -1;
    *why = "a node has more records or reasons than the bounds";
    nd = cJSON_GetArraySize(deltas);
    if (nd < 0 || nd > VERDICTS_PER_NODE || cJSON_GetArraySize(counts) > VERDICT_REASONS_MAX)
        return -1;
    e = &v->nodes[v->n];
    memset(e, 0, sizeof(*e));
    snprintf(e->node_id, sizeof(e->node_id), "%s", id);
    *why = "a count is not a reason with a count";
    cJSON_ArrayForEach(it, counts) {
        uint64_t n;
        if (it->string == NULL || !reason_valid(it->string) || u64_of(it, &n) != 0 ||
            __builtin_add_overflow(sum, n, &sum))
            return -1;
        for (size_t i = 0; i < e->ncounts; i++)
            if (strcmp(e->counts[i].reason, it->string) == 0)
                return -1;
        snprintf(e->counts[e->ncounts].reason, sizeof(e->counts[0].reason), "%s", it->string);
        e->counts[e->ncounts++].n = n;
    }
    *why = "a node's counts do not add up to its total";
    if (sum != total)
        return -1;
    e->total = total;
    /* the file lists the newest first: the ring holds the oldest at head */
    *why = "a record is malformed";
    for (int i = nd - 1; i >= 0; i--)
        if (parse_record(cJSON_GetArrayItem(deltas, i), &e->ring[e->n++]) != 0)
            return -1;
    e->seen = ++v->clock;
    v->n++;
    return 0;
}

int verdicts_parse(verdicts *v, const char *text, size_t len, dl_error *err)
{
    cJSON *root = len <= VERDICTS_FILE_MAX ? cJSON_ParseWithLength(text, len) : NULL;
    const cJSON *nodes = cJSON_GetObjectItemCaseSensitive(root, "nodes"), *it;
    const cJSON *version = cJSON_GetObjectItemCaseSensitive(root, "version");
    const char *why = "not a JSON object of version 1 with nodes (or over its size cap)";
    uint64_t dropped = 0;
    int rc = 0;

    if (!cJSON_IsObject(root) || !cJSON_IsNumber(version) || version->valuedouble != 1 || !cJSON_IsArray(nodes) ||
        u64_of(cJSON_GetObjectItemCaseSensitive(root, "dropped_nodes"), &dropped) != 0)
        goto bad;
    why = "more nodes than the table keeps";
    if (cJSON_GetArraySize(nodes) > VERDICTS_NODES_MAX)
        goto bad;
    cJSON_ArrayForEach(it, nodes)
        if (parse_node(v, it, &why) != 0)
            goto bad;
    v->dropped_nodes = dropped;
    goto out;
bad:
    v->n = 0;
    v->clock = 0;
    rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s", why);
out:
    cJSON_Delete(root);
    return rc;
}
