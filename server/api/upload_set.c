/* upload_set: the parts of a sharded delta uploaded over HTTP, PUT /nodes/{id}/delta_{n}-0000i-of-0000N.safetensors
 * and PUT /nodes/{id}/delta_{n}.safetensors.index.json (st_index.h), in any order, staged per node
 * until the set is complete, then taken in as a whole.
 *
 * A shard streams like a whole delta (upload.c; its header checked on its own:
 * delta_check_shard_header) into the staging directory of its set, cache/incoming/set-<node>-<k>/,
 * one per node and local step; the index (at most ST_INDEX_MAX_BYTES) is parsed and its metadata
 * checked against the path on the pool and written next to them.  When the index and every shard it
 * lists are in, the set is checked as a whole (st_set_assemble, delta_check_set_header), linked into
 * the cache and offered to the round: that part is answered with the round's verdict, every earlier
 * part with 202, counts and the first few parts still missing.  A set's shard count is fixed by the
 * first part that names it (a shard's request, the index once parsed) and its arrays sized then; an
 * index is reconciled with the shards in (count, total_size) before it is written and again on the
 * loop.  A staged set is bounded (its shards by the single-delta body limit, its index by the index
 * cap, its shard count by the model's floating tensors), is replaced by a newer local step of its
 * node, and goes (directory and memory) when its round moves on or it is refused. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "dl_log.h"
#include "fsutil.h"
#include "intake.h"
#include "st_index.h"
#include "store.h"
#include "strbuf.h"
#include "upload_internal.h"

/* ---- staged sets of a sharded delta ------------------------------------------------------------ */

/* Answers a part of a set that was discarded meanwhile, as the discard said. */
static void reject_dead(upload *u, const stage *s)
{
    upload_reject(u, s->dead_status, s->dead_code, s->dead_why, NULL);
}

/* The staged sets: the uploads' own state (the daemon has no slot for them) and a process runs one
 * daemon, so the table is this file's, bound to the daemon that stages (sets.d). */
static struct {
    dilocod *d;
    stage *head;
    size_t n;
    uv_prepare_t watch;         /* notices a round that moved on, each time before the loop waits */
    int watch_ready;
} sets;

static void set_complete(stage *s, upload *responder);

static int stage_complete(const stage *s)
{
    return s->index_bytes != 0 && s->nshards != 0 && s->nreceived == s->nshards;
}

static void stage_free(stage *s)
{
    free(s->dir);
    free(s->part_bytes);
    free(s->part_data);
    free(s->part_norm);
    free(s);
}

static void stage_remove_work(pool_job *j)
{
    stage *s = j->arg;
    int rc = store_remove_tree(s->dir);
    if (rc != 0 && rc != -ENOENT)
        dl_fail_errno(&j->err, -rc, "removing %s", s->dir);
    j->rc = rc == -ENOENT ? 0 : rc;
}

static void stage_remove_done(pool_job *j)
{
    stage *s = j->arg;
    if (j->rc != 0) {
        char m[600];
        dl_log(DL_LOG_ERROR, "http", "cannot remove a sharded upload's staging", "dir=%s error=%s", s->dir,
               dl_log_q(m, sizeof(m), j->err.message));
    }
    stage_free(s);
}

/* Frees a discarded set once no part and no job uses it; its directory is removed on the pool. */
static void stage_reap(stage *s)
{
    if (!s->dead || s->refs > 0 || s->completing || s->reaped)
        return;
    s->reaped = 1;
    if (daemon__queue(s->d, stage_remove_work, stage_remove_done, s) != 0) {
        (void)store_remove_tree(s->dir);        /* the pool refused (out of memory): here, once */
        stage_free(s);
    }
}

/* Takes s off the table at once (a new set of the node starts clean); a part still in flight is
 * answered dead_status/dead_code/why (status 0: the set was taken in, nothing to say). */
static void stage_discard(stage *s, int status, const char *code, const char *why)
{
    stage **pp;
    char qn[160], m[300];

    if (s->dead) {
        stage_reap(s);          /* discarded while its intake ran: it may be free to go now */
        return;
    }
    for (pp = &sets.head; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == s) {
            *pp = s->next;
            sets.n--;
            break;
        }
    }
    s->dead = 1;
    s->dead_status = status;
    snprintf(s->dead_code, sizeof(s->dead_code), "%s", code);
    snprintf(s->dead_why, sizeof(s->dead_why), "%s", why);
    if (status != 0)
        dl_log(DL_LOG_INFO, "http", "sharded upload discarded",
               "node=%s local_step=%" PRIu64 " shards=%u/%u index=%s bytes=%" PRIu64 " reason=%s",
               dl_log_q(qn, sizeof(qn), s->node_id), s->local_step, s->nreceived, s->nshards,
               s->index_bytes ? "yes" : "no", s->bytes + s->index_bytes, dl_log_q(m, sizeof(m), why));
    stage_reap(s);
}

/* A round that moved on (or a stop) takes its staged sets with it. */
static void sets_sweep(dilocod *d)
{
    stage *s, *next;
    char why[200];

    for (s = sets.head; s != NULL; s = next) {
        next = s->next;
        if (daemon_stopping(d)) {
            stage_discard(s, 503, "shutting_down", "the server is stopping");
        } else if (s->round_step != daemon_round(d)->step) {
            snprintf(why, sizeof(why), "the round for step %" PRIu64 " ended before the set was complete",
                     s->round_step);
            stage_discard(s, 409, "stale", why);
        }
    }
}

static void watch_cb(uv_prepare_t *h)
{
    sets_sweep(sets.d);
    if (sets.head == NULL)
        uv_prepare_stop(h);
}

static void watch_start(dilocod *d)
{
    if (!sets.watch_ready || sets.d != d) {
        /* never fails for a prepare handle; unref'd: it never keeps the loop alive on its own */
        uv_prepare_init(daemon_loop(d), &sets.watch);
        uv_unref((uv_handle_t *)&sets.watch);
        sets.watch_ready = 1;
        sets.d = d;
    }
    if (!uv_is_closing((uv_handle_t *)&sets.watch))
        uv_prepare_start(&sets.watch, watch_cb);
}

static stage *stage_find(const char *node_id)
{
    for (stage *s = sets.head; s != NULL; s = s->next)
        if (strcmp(s->node_id, node_id) == 0)
            return s;
    return NULL;
}

/* At most one set per node, and no more nodes than a round can take. */
static size_t stage_limit(const dilocod *d)
{
    return daemon_config(d)->expected_nodes ? daemon_config(d)->expected_nodes : CONFIG_MAX_NODES;
}

/* Fixes the set's shard count (nshards != 0, the set's still 0) and sizes its arrays by it. */
static int stage_fix_count(stage *s, uint32_t nshards)
{
    uint64_t *bytes = calloc(nshards, sizeof(*bytes)), *data = calloc(nshards, sizeof(*data));
    delta_norm *norms = calloc(nshards, sizeof(*norms));

    if (bytes == NULL || data == NULL || norms == NULL) {
        free(bytes);
        free(data);
        free(norms);
        return -ENOMEM;
    }
    s->part_bytes = bytes;
    s->part_data = data;
    s->part_norm = norms;
    s->nshards = nshards;
    return 0;
}

static stage *stage_new(dilocod *d, const char *node_id, uint64_t local_step, uint32_t nshards)
{
    stage *s = calloc(1, sizeof(*s));

    if (s == NULL)
        return NULL;
    s->d = d;
    snprintf(s->node_id, sizeof(s->node_id), "%s", node_id);
    s->local_step = local_step;
    s->round_step = daemon_round(d)->step;
    if ((s->dir = store_path_incoming_file(daemon_store(d)->dir, "set-%s-%u", node_id, upload_next_id())) == NULL) {
        stage_free(s);
        return NULL;
    }
    if (nshards != 0 && stage_fix_count(s, nshards) != 0) {
        stage_free(s);
        return NULL;
    }
    s->next = sets.head;
    sets.head = s;
    sets.n++;
    watch_start(d);
    return s;
}

/* A part is done with its set (in, refused or aborted): the last one out of a complete set starts
 * its intake (nobody left to answer for it: the round's log says what became of it). */
void set_part_release(upload *u)
{
    stage *s = u->stage;

    if (s == NULL)
        return;
    u->stage = NULL;
    s->reserved -= u->reserved;
    u->reserved = 0;
    if (u->kind == UP_INDEX)
        s->index_streaming = 0;
    s->refs--;
    if (s->dead)
        stage_reap(s);
    else if (stage_complete(s) && s->refs == 0 && !s->completing)
        set_complete(s, NULL);
}
static void part_in(upload *u);

/* A shard's tensor bytes (what the index's total_size sums), known once its header is. */
static uint64_t shard_data_bytes(const upload *u)
{
    return u->ds.file_len - 8 - u->ds.n;
}

void set_shard_in(upload *u, uint64_t size)
{
    stage *s = u->stage;

    if (s->dead) {              /* renamed into a discarded set: it goes with its directory */
        reject_dead(u, s);
        return;
    }
    if (u->nshards != s->nshards || u->shard >= s->nshards) {
        /* never: the shard's request fixed the count or was refused for disagreeing with it */
        upload_reject(u, 500, "internal", "the shard does not fit its set's count", NULL);
        return;
    }
    if (s->part_bytes[u->shard] == 0)
        s->nreceived++;
    s->bytes = s->bytes - s->part_bytes[u->shard] + size;
    s->part_bytes[u->shard] = size;
    s->data = s->data - s->part_data[u->shard] + shard_data_bytes(u);
    s->part_data[u->shard] = shard_data_bytes(u);
    s->part_norm[u->shard] = u->ds.norm;        /* a shard sent again replaces its part */
    s->reserved -= u->reserved;
    u->reserved = 0;
    part_in(u);
}
/* ---- parts of a sharded delta ------------------------------------------------------------------ */

/* A shard's header, checked on its own (parsed on the pool): every tensor a floating key of the
 * global with its shape and a delta dtype.  delta_stream_parse_header would apply the rules of a
 * whole delta (metadata, every key) that only the set as a whole meets. */
int set_shard_parse_header(upload *u, dl_error *err)
{
    int rc = delta_stream_parse_header_only(&u->ds, err);

    if (rc != 0)
        return rc;
    return delta_check_shard_header(u->ds.h, u->gby, u->ngby, NULL, err);     /* before the index: not known */
}

/* A shard's own metadata, when it carries the delta's (huggingface_hub's shards carry only
 * "format"): node_id and local_step must agree with the path; base_outer_step answers early. */
static int shard_meta(upload *u, delta_info *info, int *have_base)
{
    const st_header *h = u->ds.h;
    const char *v;
    size_t len;
    uint64_t n;
    char msg[240];

    *have_base = 0;
    memset(info, 0, sizeof(*info));
    snprintf(info->node_id, sizeof(info->node_id), "%s", u->node_id);
    info->local_step = u->local_step;
    if ((v = st_header_meta(h, "node_id", &len)) != NULL && (len != strlen(u->node_id) || memcmp(v, u->node_id, len))) {
        snprintf(msg, sizeof(msg), "the shard's metadata node_id does not match the path's node id \"%s\"", u->node_id);
        daemon_verdict_rejected(u->d, u->node_id, NULL, DL_E_PATH_MISMATCH, 422, msg, NULL);
        upload_reject(u, 422, "path_mismatch", msg, NULL);
        return API_ANSWERED;
    }
    if ((v = st_header_meta(h, "local_step", &len)) != NULL &&
        (delta_parse_int(v, len, &n) != 0 || n != u->local_step)) {
        snprintf(msg, sizeof(msg), "the shard's metadata local_step does not match the path's step %" PRIu64,
                 u->local_step);
        daemon_verdict_rejected(u->d, u->node_id, NULL, DL_E_PATH_MISMATCH, 422, msg, NULL);
        upload_reject(u, 422, "path_mismatch", msg, NULL);
        return API_ANSWERED;
    }
    if ((v = st_header_meta(h, "base_outer_step", &len)) != NULL) {
        if (delta_parse_int(v, len, &info->base_outer_step) != 0) {
            static const char bad_base[] = "the shard's metadata base_outer_step is not a canonical integer";
            daemon_verdict_rejected(u->d, u->node_id, NULL, DL_E_METADATA_INVALID, 422, bad_base, NULL);
            upload_reject(u, 422, "metadata_invalid", bad_base, NULL);
            return API_ANSWERED;
        }
        *have_base = 1;
    }
    return 0;
}

/* A shard's header is in: the round (from the set's index, or the shard's own metadata) and the
 * set's byte cap decide whether its data is read. */
int set_shard_verdict(upload *u)
{
    stage *s = u->stage;
    dilocod *d = u->d;
    delta_info info;
    int have_base;
    uint64_t cap = upload_body_limit(d), others, len = u->ds.file_len, tdata;
    char msg[240];

    if (s->dead) {
        reject_dead(u, s);
        return API_ANSWERED;
    }
    if (u->nshards != s->nshards || u->shard >= s->nshards) {
        /* never: the shard's request fixed the count or was refused for disagreeing with it */
        upload_reject(u, 500, "internal", "the shard does not fit its set's count", NULL);
        return API_ANSWERED;
    }
    if (shard_meta(u, &info, &have_base) != 0)
        return API_ANSWERED;
    /* mis-sized against the index in: the tensor data of the shards in (an earlier copy of this one
     * excepted) and this one's, above the index's total_size */
    tdata = shard_data_bytes(u);
    if (s->index_bytes != 0 &&
        (tdata > s->total_size || s->data - s->part_data[u->shard] > s->total_size - tdata)) {
        snprintf(msg, sizeof(msg), "the set's shards would hold more tensor data than the index's total_size of "
                 "%" PRIu64 " bytes", s->total_size);
        daemon_verdict_rejected(d, u->node_id, NULL, DL_E_METADATA_INVALID, 422, msg, NULL);
        upload_reject(u, 422, "metadata_invalid", msg, NULL);
        return API_ANSWERED;
    }
    if (s->index_bytes != 0) {
        info = s->info;
        have_base = 1;
    }
    if (have_base && upload_peek(u, &info) != 0)
        return API_ANSWERED;
    /* the shards staged (an earlier copy of this one excepted) and those streaming, plus this one */
    others = s->bytes - s->part_bytes[u->shard] + s->reserved;
    if (len > cap || others > cap - len) {
        snprintf(msg, sizeof(msg), "the set's shards would hold %" PRIu64 " bytes, more than the limit of %" PRIu64,
                 others + len, cap);
        upload_reject(u, 413, "too_large", msg, NULL);
        return API_ANSWERED;
    }
    s->reserved += len;
    u->reserved = len;
    return 0;
}

/* 202: what the set has and what it still needs, bounded whatever the set's size: counts, and the
 * first PARTIAL_NAMED missing parts by name (an answer naming every missing shard was 740 KB at
 * 20,000 shards, sent again for every shard). */
#define PARTIAL_NAMED 8

static void partial_name(sbuf *b, const char *name, unsigned *named)
{
    if (*named >= PARTIAL_NAMED)
        return;
    if (*named > 0)
        sb_str(b, ",");
    sb_json_string(b, name, strlen(name));
    (*named)++;
}

static void respond_partial(upload *u, const stage *s, uint64_t size)
{
    sbuf b = {0};
    char num[320], name[PART_NAME_MAX], base[40];
    unsigned named = 0;
    uint64_t received = s->nreceived + (s->index_bytes != 0);
    uint64_t missing = (uint64_t)(s->nshards - s->nreceived) + (s->index_bytes == 0);

    if (!http_conn_alive(u->c))
        return;
    snprintf(base, sizeof(base), "delta_%" PRIu64, s->local_step);
    snprintf(num, sizeof(num),
             "{\"node_id\":\"%s\",\"local_step\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"result\":\"incomplete\",\"part\":",
             s->node_id, s->local_step, size);
    sb_str(&b, num);
    sb_json_string(&b, u->part, strlen(u->part));
    /* shards 0 while no part has named the count: the missing shards are then not known, only the index */
    snprintf(num, sizeof(num), ",\"set\":{\"shards\":%u,\"index\":%s,\"bytes\":%" PRIu64 ",\"parts_in_flight\":%d,"
             "\"received\":%" PRIu64 ",\"missing_count\":%" PRIu64 ",\"missing\":[",
             s->nshards, s->index_bytes != 0 ? "true" : "false", s->bytes + s->index_bytes, s->refs, received, missing);
    sb_str(&b, num);
    for (uint32_t i = 0; i < s->nshards && named < PARTIAL_NAMED; i++) {
        if (s->part_bytes[i] != 0)
            continue;
        st_index_shard_name(base, i, s->nshards, name, sizeof(name));
        partial_name(&b, name, &named);
    }
    if (s->index_bytes == 0) {  /* the shards, then the index, as a client sends them */
        snprintf(name, sizeof(name), "%s" ST_INDEX_SUFFIX, base);
        partial_name(&b, name, &named);
    }
    sb_str(&b, "]}}\n");
    upload_respond_json(u, 202, &b);
}

/* A part is in its set: the set is taken in if it is now complete and no other part of it is still
 * streaming (this part then gets the round's verdict), else this part gets 202.  The caller
 * discards u afterwards (it waits for the set's intake when it answers for it). */
static void part_in(upload *u)
{
    stage *s = u->stage;
    uint64_t size = u->kind == UP_INDEX ? s->index_bytes : s->part_bytes[u->shard];
    char qn[160], qp[PART_NAME_MAX + 8];

    dl_log(DL_LOG_INFO, "http", "sharded upload part received",
           "node=%s local_step=%" PRIu64 " part=%s bytes=%" PRIu64 " shards=%u/%u index=%s",
           dl_log_q(qn, sizeof(qn), s->node_id), s->local_step, dl_log_q(qp, sizeof(qp), u->part), size,
           s->nreceived, s->nshards, s->index_bytes ? "yes" : "no");
    u->stage = NULL;            /* this part's reference goes now: the set counts only those still streaming */
    if (u->kind == UP_INDEX)
        s->index_streaming = 0;
    s->refs--;
    if (stage_complete(s) && s->refs == 0 && !s->completing) {
        set_complete(s, u);
        return;
    }
    respond_partial(u, s, size);
}

/* ---- the index ---- */

static int index_on_data(http_conn *c, const char *p, size_t n, void *ctx)
{
    upload *u = ctx;
    char msg[160];

    (void)c;
    if (upload_body_read(u, n) != 0)
        return API_ANSWERED;
    /* the model's cap: an index lists its floating tensors */
    size_t cap = daemon_model(u->d) ? st_index_cap_for(daemon_model(u->d)) : ST_INDEX_MAX_BYTES;
    if (n > cap - u->body.len) {
        snprintf(msg, sizeof(msg), "an index for this model is at most %zu bytes", cap);
        upload_reject(u, 413, "too_large", msg, NULL);
        upload_discard(u);
        return API_ANSWERED;
    }
    sb_add(&u->body, p, n);
    if (u->body.oom) {
        upload_reject(u, 500, "out_of_memory", "out of memory buffering the index", NULL);
        upload_discard(u);
        return API_ANSWERED;
    }
    return 0;
}

/* An index against the set's fixed count and the tensor bytes of its shards in (on the pool with
 * their state when its body ended, on the loop with the state now): 0, or DL_E_INVALID_PATH for
 * another count, DL_E_METADATA_INVALID for a total_size below what the shards in hold. */
static int index_reconcile(const upload *u, uint32_t nshards, uint64_t data, dl_error *err)
{
    if (nshards != 0 && u->nshards != nshards)
        return dl_fail(err, DL_E_INVALID_PATH, NULL, 0, "the index lists %u shards; the set being uploaded has %u "
                       "(the count its first part named)", u->nshards, nshards);
    if (data > u->total_size)
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "the index's total_size is %" PRIu64 " but the shards "
                       "already in hold %" PRIu64 " bytes of tensor data", u->total_size, data);
    return 0;
}

/* On the pool: parse the index strictly, check its metadata against the path and its keys against
 * the global's floating keys, and write it into the set's directory (durable: it is linked into the
 * cache as it is).  u->index_nfloat: how many floating tensors the global has. */
static void index_work(pool_job *j)
{
    upload *u = j->arg;
    const dilocod *d = daemon_of_job(j);
    st_index *ix = NULL;
    char base[40], *path = NULL;
    int rc;

    snprintf(base, sizeof(base), "delta_%" PRIu64, u->local_step);
    if ((rc = st_index_parse_capped(u->body.p ? u->body.p : "", u->body.len, base, st_index_cap_for(daemon_model(d)), &ix,
                                    &j->err)) != 0)
        goto out;
    if ((rc = delta_check_meta(ix->meta, ix->nmeta, u->rel, &u->ds.info, &j->err)) != 0)
        goto out;
    uint64_t nscales = 0;
    for (size_t i = 0; i < ix->nentries; i++) {
        const st_index_entry *e = &ix->entries[i];
        const st_tensor *t = st_header_find(daemon_model(d), e->name, e->name_len);
        /* a compressed set's scales: named after a floating key (the set's check matches them to its codes) */
        if (t == NULL && u->ds.info.cz.enc != CZ_NONE && cz_is_scales_name(e->name, e->name_len)) {
            t = st_header_find(daemon_model(d), e->name, e->name_len - CZ_SCALES_SUFFIX_LEN);
            if (t != NULL && st_dtype_is_floating(t->dtype)) {
                nscales++;
                continue;
            }
            t = NULL;
        }
        if (t == NULL || !st_dtype_is_floating(t->dtype)) {
            rc = dl_fail(&j->err, DL_E_KEY_MISMATCH, e->name, e->name_len,
                         t != NULL ? "the index lists a non-floating key of the global model"
                                   : "the index lists a key the global model does not have");
            goto out;
        }
    }
    if (ix->nentries != u->index_nfloat + nscales) {
        rc = dl_fail(&j->err, DL_E_KEY_MISMATCH, NULL, 0, "the index lists %zu tensors; the global has %" PRIu64
                     " floating tensors (and the index %" PRIu64 " compressed keys' scales)", ix->nentries,
                     u->index_nfloat, nscales);
        goto out;
    }
    u->nshards = ix->nshards;
    u->total_size = ix->total_size;
    /* reconciled with the shards in (u->set_*: their state when the body ended), before it is
     * written: an index of the set is refused here, never written over the one the set has */
    if ((rc = index_reconcile(u, u->set_nshards, u->set_data, &j->err)) != 0) {
        u->unreconciled = 1;
        goto out;
    }
    if ((rc = fsu_mkdirs(u->stage->dir, &j->err)) != 0)
        goto out;
    if (asprintf(&path, "%s/%s", u->stage->dir, u->part) < 0) {
        path = NULL;
        rc = dl_fail(&j->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    rc = fsu_write_atomic(path, u->body.p, u->body.len, &j->err);
out:
    j->rc = rc;
    free(path);
    st_index_free(ix);
}

static void index_done(pool_job *j)
{
    upload *u = j->arg;
    stage *s = u->stage;
    char msg[sizeof(((dl_error *)0)->message) + 64];
    dl_error err;

    u->parsing = 0;
    if (u->failed || u->aborted) {
        upload_discard(u);
        return;
    }
    if (j->rc != 0) {
        upload_reject_err(u, &j->err);         /* a bad index alone: the set waits for a good one */
        if (u->unreconciled && !s->dead) {
            snprintf(msg, sizeof(msg), "the set's index disagrees with its shards: %s", j->err.message);
            stage_discard(s, 409, "set_refused", msg);
        }
        upload_discard(u);
        return;
    }
    if (s->dead) {
        reject_dead(u, s);
        upload_discard(u);
        return;
    }
    /* shards that started or came in while it was parsed: a count fixed by a shard's request
     * meanwhile, more tensor data than total_size.  Either side may be the wrong one: the set
     * starts over (and the index text written meanwhile goes with it) */
    if (index_reconcile(u, s->nshards, s->data, &err) != 0) {
        upload_reject_err(u, &err);
        snprintf(msg, sizeof(msg), "the set's index disagrees with its shards: %s", err.message);
        stage_discard(s, 409, "set_refused", msg);
        upload_discard(u);
        return;
    }
    if (upload_peek(u, &u->ds.info) != 0) {
        snprintf(msg, sizeof(msg), "the set's index was refused by the round (%s)",
                 round_verdict_name(daemon__peek(u->d, &u->ds.info)));
        stage_discard(s, 409, "set_refused", msg);
        upload_discard(u);
        return;
    }
    if (s->nshards == 0 && stage_fix_count(s, u->nshards) != 0) {
        upload_reject(u, 500, "out_of_memory", "out of memory", NULL);
        upload_discard(u);
        return;
    }
    s->info = u->ds.info;
    s->index_bytes = u->body.len;
    s->total_size = u->total_size;
    part_in(u);
    upload_discard(u);
}

static void index_on_end(http_conn *c, void *ctx)
{
    upload *u = ctx;
    uint64_t nfloat = 0;

    (void)c;
    if (u->failed)
        return;
    for (size_t i = 0; i < daemon_model(u->d)->ntensors; i++)
        nfloat += st_dtype_is_floating(daemon_model(u->d)->tensors[i].dtype) != 0;
    u->set_nshards = u->stage->nshards;
    u->set_data = u->stage->data;
    u->parsing = 1;
    u->index_nfloat = nfloat;
    if (daemon__queue(u->d, index_work, index_done, u) != 0) {
        u->parsing = 0;
        upload_reject(u, 500, "internal", "cannot queue the index's parse", NULL);
        upload_discard(u);
    }
}

/* an abort is the same for every kind of upload (upload_on_abort) */
static const http_body_ops index_ops = {index_on_data, index_on_end, upload_on_abort};

/* ---- a complete set ---- */

typedef struct complete_args {
    stage *s;
    upload *u;                  /* answers for the set, or NULL */
    const st_tensor **gby;      /* the global's tensors by name */
    size_t ngby;
    char rel[160];              /* nodes/<id>/delta_<n>.safetensors.index.json */
    delta_info info;
    delta_norm codes_norm;      /* a compressed set's: its codes' values (the shards' streams skipped them) */
    char *cache_path;
    uint64_t size;
    intake_status st;
} complete_args;

/* A compressed set's codes, shard by shard (each holds its keys' codes and scales, delta_check_set_header):
 * decoded and checked finite from our staged copies, their norm into *norm. */
static intake_status check_set_codes(const st_header *global, const st_set *set, delta_info *info, delta_norm *norm,
                                     dl_error *err)
{
    intake_status st = INTAKE_OK;

    for (size_t i = 0; i < set->nfiles && st == INTAKE_OK; i++) {
        const st_file *f = set->files[i];
        int fd;
        if (st_file_acquire(f, &fd, err) != 0)
            return INTAKE_IO;
        st = intake_check_codes(global, fd, f->h, info, norm, err);
        st_file_release(f);
    }
    return st;
}

/* On the pool: the set as a whole (every listed tensor in its shard and in no other, total_size, the
 * metadata against the path, the union of keys against the global), then linked into the cache. */
static void complete_work(pool_job *j)
{
    complete_args *a = j->arg;
    const stage *s = a->s;
    st_index *ix = NULL;
    st_set *set = NULL;
    char *ipath = NULL;
    uint64_t shard_bytes = 0;

    a->st = INTAKE_INVALID;
    if (asprintf(&ipath, "%s/delta_%" PRIu64 ST_INDEX_SUFFIX, s->dir, s->local_step) < 0) {
        ipath = NULL;
        dl_fail(&j->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        a->st = INTAKE_IO;
    } else if (st_index_load(ipath, &ix, &j->err) != 0) {
        a->st = j->err.code == DL_E_IO || j->err.code == DL_E_NO_MEMORY ? INTAKE_IO : INTAKE_INVALID;
    } else if ((a->st = intake_check_set_dir(s->dir, ix, a->gby, a->ngby, a->rel, &a->info, &set, &shard_bytes,
                                             &j->err)) == INTAKE_OK &&
               (a->info.cz.enc == CZ_NONE ||
                (a->st = check_set_codes(daemon_model(daemon_of_job(j)), set, &a->info, &a->codes_norm, &j->err)) ==
                    INTAKE_OK)) {
        a->size = s->index_bytes + shard_bytes;
        a->st = intake_link_set_into_cache(daemon_store(daemon_of_job(j))->dir, &a->info, s->dir, set->index, &a->cache_path, &j->err);
    }
    st_set_close(set);
    free(ipath);
}

static void complete_done(pool_job *j)
{
    complete_args *a = j->arg;
    stage *s = a->s;
    upload *u = a->u;
    dilocod *d = daemon_of_job(j);

    s->completing = 0;
    if (a->st == INTAKE_OK) {
        /* the set's norm: its shards' exact sums merged (delta_norm.h) */
        delta_norm total = a->codes_norm;
        for (uint32_t i = 0; i < s->nshards; i++)
            delta_norm_merge(&total, &s->part_norm[i]);
        a->info.norm = sqrt(delta_norm_sumsq(&total));
        a->info.has_norm = 1;
        /* the set is in the cache: whatever happens to the connection, the round gets it */
        round_verdict v = daemon__offer(d, &a->info, a->cache_path, a->size);
        a->cache_path = NULL;
        if (u != NULL && round_verdict_taken(v))
            upload_respond_created(u, &a->info, a->rel, v, a->size);
        else if (u != NULL)
            upload_reject_verdict(u, &a->info, v);
        stage_discard(s, 0, "", "");
    } else {
        char why[sizeof(j->err.message) + 32];
        if (a->st == INTAKE_DUPLICATE) {
            dl_fail(&j->err, DL_E_IO, NULL, 0, "this node's delta for this local_step is already in the round");
            daemon_verdict_refused(d, a->info.node_id, &a->info, ROUND_NOT_NEWER, u != NULL ? 409 : 0, j->err.message);
            if (u != NULL)
                upload_reject(u, 409, "not_newer", j->err.message, NULL);
        } else if (u != NULL) {
            upload_reject_err(u, &j->err);
        } else {
            daemon__rejected(d, a->rel, a->rel, &a->info, &j->err);
        }
        snprintf(why, sizeof(why), "the set was refused: %s", j->err.message);
        stage_discard(s, 409, "set_refused", why);
    }
    free(a->cache_path);
    free(a->gby);
    free(a);
    if (u != NULL) {
        u->completing = 0;
        upload_discard(u);
    }
}

/* Every part is in: check the set and take it in on the pool; responder (if any) gets the verdict. */
static void set_complete(stage *s, upload *responder)
{
    dilocod *d = s->d;
    complete_args *a = calloc(1, sizeof(*a));
    dl_error err;

    if (a == NULL || delta_header_by_name(daemon_model(d), &a->gby, &err) != 0) {
        free(a);
        if (responder != NULL)
            upload_reject(responder, 500, "out_of_memory", "out of memory", NULL);
        stage_discard(s, 500, "out_of_memory", "out of memory taking the set in");
        return;
    }
    a->s = s;
    a->u = responder;
    a->ngby = daemon_model(d)->ntensors;
    snprintf(a->rel, sizeof(a->rel), "nodes/%s/delta_%" PRIu64 ST_INDEX_SUFFIX, s->node_id, s->local_step);
    s->completing = 1;
    if (responder != NULL)
        responder->completing = 1;
    if (daemon__queue(d, complete_work, complete_done, a) != 0) {
        s->completing = 0;
        if (responder != NULL) {
            responder->completing = 0;
            upload_reject(responder, 500, "internal", "cannot queue the set's intake", NULL);
        }
        free(a->gby);
        free(a);
        stage_discard(s, 500, "internal", "cannot queue the set's intake");
    }
}

/* PUT of a shard or an index: the round's answer as far as the path allows, then the node's set. */
void set_part_start(dilocod *d, http_conn *c, http_request *req, const delta_path *dp)
{
    delta_info probe;
    stage *s;
    upload *u;
    uint32_t nfloat = 0;
    upload_kind kind = dp->kind == DELTA_PATH_INDEX ? UP_INDEX : UP_SHARD;
    char base[40], part[PART_NAME_MAX], msg[240], *tmp = NULL;

    if (upload_admit(d, c, req, dp->node_id) != 0)
        return;
    sets_sweep(d);              /* a round that moved on takes its sets now, not at the next loop turn */
    for (size_t i = 0; i < daemon_model(d)->ntensors; i++)
        nfloat += st_dtype_is_floating(daemon_model(d)->tensors[i].dtype) != 0;
    snprintf(base, sizeof(base), "delta_%" PRIu64, dp->local_step);
    if (kind == UP_INDEX) {
        snprintf(part, sizeof(part), "%s" ST_INDEX_SUFFIX, base);
        if (req->has_length && req->content_length > st_index_cap_for(daemon_model(d))) {
            snprintf(msg, sizeof(msg), "an index for this model is at most %zu bytes; this one has %" PRIu64,
                     st_index_cap_for(daemon_model(d)), req->content_length);
            http_respond_error(c, 413, "too_large", msg, NULL);
            return;
        }
    } else {
        st_index_shard_name(base, dp->shard, dp->nshards, part, sizeof(part));
        if (dp->nshards > nfloat) {
            /* huggingface_hub never writes an empty shard: each holds at least one tensor */
            snprintf(msg, sizeof(msg), "a set of %u shards for a model of %u floating tensors: every shard holds "
                     "at least one tensor", dp->nshards, nfloat);
            daemon_verdict_rejected(d, dp->node_id, NULL, DL_E_INVALID_PATH, 422, msg, NULL);
            upload_refuse(c, dp->node_id, 422, "invalid_path", msg, NULL);
            return;
        }
        if (req->has_length && req->content_length > upload_body_limit(d)) {
            snprintf(msg, sizeof(msg), "body of %" PRIu64 " bytes is larger than the limit of %" PRIu64,
                     req->content_length, upload_body_limit(d));
            http_respond_error(c, 413, "too_large", msg, NULL);
            return;
        }
    }
    /* before the metadata: the node, its step, a closed or full round */
    memset(&probe, 0, sizeof(probe));
    snprintf(probe.node_id, sizeof(probe.node_id), "%s", dp->node_id);
    probe.local_step = dp->local_step;
    probe.base_outer_step = daemon_round(d)->step;
    if (upload_peek_or_refuse(d, c, &probe, 0) != 0)
        return;
    s = stage_find(dp->node_id);
    if (s != NULL && s->local_step > dp->local_step) {
        snprintf(msg, sizeof(msg), "node %s is uploading the set of local_step %" PRIu64 ", a later one", dp->node_id,
                 s->local_step);
        daemon_verdict_refused(d, dp->node_id, NULL, ROUND_NOT_NEWER, 409, msg);
        upload_refuse(c, dp->node_id, 409, "not_newer", msg, NULL);
        return;
    }
    if (s != NULL && s->local_step < dp->local_step) {
        snprintf(msg, sizeof(msg), "node %s started the set of local_step %" PRIu64 ", a later one", dp->node_id,
                 dp->local_step);
        stage_discard(s, 409, "not_newer", msg);
        s = NULL;
    }
    if (s != NULL && s->completing) {
        static const char body[] =
            "{\"error\":{\"code\":\"busy\",\"message\":\"the set is being taken in; retry shortly\"}}\n";
        http_respond(c, 503, "application/json", "Retry-After: 1\r\n", body, sizeof(body) - 1);
        return;
    }
    if (s != NULL && kind == UP_INDEX && s->index_streaming) {
        /* one index at a time: the one in flight is reconciled and written before another is read */
        static const char body[] =
            "{\"error\":{\"code\":\"busy\",\"message\":\"an index of this set is being received; retry shortly\"}}\n";
        http_respond(c, 503, "application/json", "Retry-After: 1\r\n", body, sizeof(body) - 1);
        return;
    }
    if (s != NULL && kind == UP_SHARD && s->nshards != 0 && s->nshards != dp->nshards) {
        snprintf(msg, sizeof(msg), "the set of local_step %" PRIu64 " being uploaded has %u shards, not %u",
                 dp->local_step, s->nshards, dp->nshards);
        daemon_verdict_rejected(d, dp->node_id, NULL, DL_E_INVALID_PATH, 422, msg, NULL);
        upload_refuse(c, dp->node_id, 422, "invalid_path", msg, NULL);
        return;
    }
    if (s != NULL && s->index_bytes != 0 && upload_peek_or_refuse(d, c, &s->info, 1) != 0)
        return;
    if (s == NULL && sets.n >= stage_limit(d)) {
        static const char body[] = "{\"error\":{\"code\":\"busy\",\"message\":"
                                   "\"too many sharded uploads in progress; retry shortly\"}}\n";
        http_respond(c, 503, "application/json", "Retry-After: 1\r\n", body, sizeof(body) - 1);
        return;
    }
    if (s == NULL && (s = stage_new(d, dp->node_id, dp->local_step, kind == UP_SHARD ? dp->nshards : 0)) == NULL) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    /* a set opened by its index (still parsing or refused): the first shard names the count */
    if (kind == UP_SHARD && s->nshards == 0 && stage_fix_count(s, dp->nshards) != 0) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    if ((u = upload_new(d, c, dp->node_id, kind)) == NULL) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        if (s->refs == 0 && s->nreceived == 0 && s->index_bytes == 0)
            stage_discard(s, 500, "out_of_memory", "out of memory");
        return;
    }
    u->stage = s;
    s->refs++;
    if (kind == UP_INDEX)
        s->index_streaming = 1;
    u->local_step = dp->local_step;
    u->shard = dp->shard;
    u->nshards = dp->nshards;
    u->by_path = 1;
    snprintf(u->part, sizeof(u->part), "%s", part);
    snprintf(u->rel, sizeof(u->rel), "nodes/%s/%s", dp->node_id, part);
    if (kind == UP_INDEX) {
        http_accept_body(c, &index_ops, u);
        return;
    }
    u->ngby = daemon_model(d)->ntensors;
    if (delta_header_by_name(daemon_model(d), &u->gby, &(dl_error){0}) != 0 ||
        asprintf(&tmp, "%s/%s.part-%u", s->dir, part, upload_next_id()) < 0)
        tmp = NULL;
    upload_stream_body(u, req, tmp);
}

