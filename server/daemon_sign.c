/* --signing-key (README "Verifiable rounds"): the key, the chain of records, each round's inputs' block
 * hashes (computed beside the pass, by the job that makes the deltas durable) and its refusals, and the
 * skeleton of a step's record (core/manifest.h) built when the step is committed: what the redo record
 * keeps, so that a step recomputed after a crash gets the same record.  A step entered whole (a
 * bootstrap, an adoption) gets a record with no inputs, written before the step is committed. */
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blockhash.h"
#include "dl_log.h"
#include "manifest.h"
#include "store.h"

int daemon__sign_open(dilocod *d, dl_error *err)
{
    d->sign.prev_step = -1;
    if (d->cfg->signing_key == NULL)
        return 0;
    if (sign_key_load(&d->sign.key, d->cfg->signing_key, err) != 0)
        return -DL_E_INVALID_ARGUMENT;
    d->sign.on = 1;
    dl_log(DL_LOG_INFO, "sign", "signing every step", "key_fingerprint=%s", d->sign.key.fingerprint);
    return 0;
}

static void known_forget(dilocod *d, size_t i)
{
    free(d->sign.known[i].path);
    d->sign.known[i] = d->sign.known[--d->sign.nknown];
}

void daemon__sign_free(dilocod *d)
{
    while (d->sign.nknown > 0)
        known_forget(d, 0);
    free(d->sign.known);
    d->sign.known = NULL;
    if (d->sign.on)
        sign_key_free(&d->sign.key);
    free(d->sign.hash);
    free(d->sign.refused);
    d->sign.hash = NULL;
    d->sign.refused = NULL;
    d->sign.on = 0;
}

/* The committed step's record, if the state holds one, is the next record's "previous" (startup, an
 * adoption, a bootstrap: a small read, once). */
void daemon__sign_chain(dilocod *d)
{
    dl_error err;
    int rc;

    static const char *const names[3] = {"global", "momentum", "accumulator"};

    d->sign.prev_step = -1;
    if (!d->sign.on || !d->st.committed)
        return;
    if ((rc = manifest_hash_of(d->st.dir, d->st.step, d->sign.prev_hash, &err)) == 0) {
        d->sign.prev_step = (int64_t)d->st.step;
        for (int i = 0; i < 3; i++)
            if (manifest_output_of(d->st.dir, d->st.step, names[i], d->sign.prev_out[i], &err) < 0)
                d->sign.prev_out[i][0] = '\0';
    }
    else if (rc < 0)
        daemon__log_error("sign", "cannot read the committed step's record: the next one has no previous", &err);
    else
        dl_log(DL_LOG_WARN, "sign", "the committed step has no signed record: the chain starts at the next step",
               "step=%" PRIu64, d->st.step);
}

void daemon__sign_recorded(dilocod *d, uint64_t step, const char *hash, const char out[3][65])
{
    if (step < d->st.step && d->sign.prev_step >= 0 && (uint64_t)d->sign.prev_step >= step)
        return;                 /* an older step's: the chain is past it */
    memcpy(d->sign.prev_hash, hash, MANIFEST_HASH_HEX);
    memcpy(d->sign.prev_out, out, sizeof(d->sign.prev_out));
    d->sign.prev_step = (int64_t)step;
}

/* ---- the round's inputs ------------------------------------------------------------------------- */

int daemon__sign_hash_delta(const char *path, char hex[MANIFEST_HASH_HEX], dl_error *err)
{
    unsigned char digest[BLOCKHASH_SIZE];
    int rc = blockhash_path(path, digest, err);

    if (rc == 0)
        blockhash_hex(digest, hex);
    return rc;
}

/* ---- hashes as deltas arrive: by the time a round closes, only its last delta is left to hash ---- */

typedef struct early_args {
    char *path;
    char hex[65];
} early_args;

static void early_work(job *j)
{
    early_args *a = j->arg;
    j->rc = daemon__sign_hash_delta(a->path, a->hex, &j->err);
}

static void early_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    early_args *a = j->arg;

    /* a failure is not reported here: the sync job beside the pass hashes what is not known, and says so */
    if (j->rc == 0 && !j->cancelled && d->sign.nknown < SIGN_KNOWN_MAX &&
        (d->sign.known != NULL || (d->sign.known = calloc(SIGN_KNOWN_MAX, sizeof(*d->sign.known))) != NULL)) {
        sign_known *k = &d->sign.known[d->sign.nknown++];
        k->path = a->path;
        memcpy(k->hex, a->hex, sizeof(k->hex));
        a->path = NULL;
    }
    free(a->path);
    free(a);
}

void daemon__sign_hash_taken(dilocod *d, const char *path)
{
    early_args *a;

    if (!d->sign.on || d->stopping || (a = calloc(1, sizeof(*a))) == NULL)
        return;
    if ((a->path = strdup(path)) == NULL || daemon__queue(d, early_work, early_done, a) != 0) {
        free(a->path);
        free(a);
    }
}

const char *daemon__sign_known(const dilocod *d, const char *path)
{
    for (size_t i = 0; i < d->sign.nknown; i++)
        if (strcmp(d->sign.known[i].path, path) == 0)
            return d->sign.known[i].hex;
    return NULL;
}

void daemon__sign_inputs_hashed(dilocod *d, uint64_t step, char (*hash)[MANIFEST_HASH_HEX], size_t n)
{
    free(d->sign.hash);
    d->sign.hash = hash;
    d->sign.nhash = n;
    d->sign.hash_step = step;
}

void daemon__sign_refused(dilocod *d, const char *node_id, const delta_info *info, const char *verdict,
                          const char *reason)
{
    sign_refusal *r;

    /* a refusal of the open round's step, kept for its record, at most SIGN_REFUSED_MAX */
    if (!d->sign.on || info == NULL || d->sign.nrefused >= SIGN_REFUSED_MAX)
        return;
    if (d->sign.refused == NULL && (d->sign.refused = calloc(SIGN_REFUSED_MAX, sizeof(*d->sign.refused))) == NULL)
        return;
    r = &d->sign.refused[d->sign.nrefused++];
    snprintf(r->node_id, sizeof(r->node_id), "%s", node_id);
    r->local_step = info->local_step;
    r->base = info->base_outer_step;
    snprintf(r->verdict, sizeof(r->verdict), "%s", verdict);
    snprintf(r->reason, sizeof(r->reason), "%s", reason);
}

/* ---- the skeleton -------------------------------------------------------------------------------- */

static void member_str(sbuf *b, const char *key, const char *v)
{
    sb_printf(b, ",\"%s\":", key);
    sb_json_string(b, v, strlen(v));
}

static void member_double(sbuf *b, const char *key, double v)
{
    sb_printf(b, ",\"%s\":", key);
    manifest_double(b, v);
}

/* Everything that changes the arithmetic of a step (README "Verifiable rounds"): the optimizer, the
 * rule, the screens, the mode and its Delayed Nesterov parameters (dn: the update's, NULL in sync), and
 * the dtype rules by name. */
static void config_json(sbuf *b, const dilocod *d, const store_dn *dn)
{
    const config *c = d->cfg;

    sb_str(b, ",\"config\":{\"mode\":");
    sb_str(b, dn != NULL && dn->on ? "\"async\"" : "\"sync\"");
    member_str(b, "optimizer", config_optimizer_name(c->optimizer));
    member_double(b, "lr", c->lr);
    member_double(b, "momentum", c->momentum);
    sb_printf(b, ",\"nesterov\":%s", c->optimizer == OPT_NESTEROV_SGD ? "true" : "false");
    member_str(b, "aggregate", config_rule_name(c->aggregate));
    if (c->aggregate == RULE_TRIMMED)
        sb_printf(b, ",\"trim_k\":%u", c->trim_k);
    if (c->aggregate == RULE_WEIGHTED)
        member_double(b, "max_weight_ratio", c->max_weight_ratio);
    member_double(b, "max_norm_ratio", c->max_norm_ratio);
    member_double(b, "max_norm", c->max_norm);
    if (c->screen)
        member_double(b, "screen_cosine", c->screen_cosine);
    else
        sb_str(b, ",\"screen_cosine\":null");
    if (dn != NULL && dn->on) {
        sb_printf(b, ",\"async\":{\"dn_period\":%u,\"dn_k\":%u", dn->period, dn->k);
        member_str(b, "dn_variant", store_dn_variant_name(dn->paper));
        member_double(b, "dn_momentum_activation", dn->c);
        member_double(b, "weight", dn->weight);
        member_str(b, "staleness_weight", config_weight_name(c->staleness_weight));
        sb_str(b, "}");
    }
    /* the rules of DESIGN "Tensor rules" and "Outer optimizer", named: a change to them is a new name */
    sb_str(b, ",\"arithmetic\":\"dilocod-1: f32 accumulation in input order, outputs rounded to the global's "
              "dtype (round to nearest even), torch.optim.SGD bit for bit\"}");
}

static void input_head(sbuf *b, int first, const char *node_id, uint64_t base, uint64_t local_step, int set)
{
    char path[DELTA_NODE_ID_MAX + 96];

    snprintf(path, sizeof(path), "nodes/%s/delta_%" PRIu64 ".safetensors%s", node_id, local_step,
             set ? ".index.json" : "");
    sb_str(b, first ? "{\"node_id\":" : ",{\"node_id\":");
    sb_json_string(b, node_id, strlen(node_id));
    member_str(b, "path", path);
    sb_printf(b, ",\"base_outer_step\":%" PRIu64 ",\"local_step\":%" PRIu64, base, local_step);
}

static int is_set(const char *path)
{
    size_t n = strlen(path), s = strlen(".index.json");
    return n > s && strcmp(path + n - s, ".index.json") == 0;
}

/* One round entry: its hash (computed beside the pass), encoding, weight and verdict. */
static void entry_json(sbuf *b, const dilocod *d, size_t i, int first, const float *scale)
{
    const round_entry *e = &d->rnd.entries[i];
    int hashed = d->sign.hash != NULL && d->sign.hash_step == d->rnd.step + 1 && i < d->sign.nhash &&
                 d->sign.hash[i][0] != '\0';

    input_head(b, first, e->node_id, e->base, e->local_step, is_set(e->path));
    if (hashed)
        member_str(b, "block_hash", d->sign.hash[i]);
    else
        sb_str(b, ",\"block_hash\":null");
    sb_printf(b, ",\"bytes\":%" PRIu64, e->size);
    member_str(b, "encoding", e->cz.enc == CZ_NONE ? "none" : cz_encoding_name(e->cz.enc));
    member_double(b, "weight", daemon__async(d) ? e->weight : 1.0);
    if (scale != NULL)
        member_double(b, "scale", *scale);
    if (e->quarantined) {
        member_str(b, "verdict", "quarantined");
        member_str(b, "reason", e->quarantine_reason);
    } else {
        member_str(b, "verdict", "aggregated");
    }
    sb_str(b, "}");
}

char *daemon__sign_skeleton(dilocod *d)
{
    uint64_t step = d->rnd.step + 1;
    const float *scales = d->agg.pass != NULL ? d->agg.pass->delta_scale : NULL;
    sbuf b = {0};
    int first = 1;

    if (!d->sign.on)
        return NULL;
    sb_printf(&b, "{\"format\":%d,\"algorithm\":\"dumb_diloco\",\"outer_step\":%" PRIu64 ",\"base_outer_step\":%" PRIu64,
              MANIFEST_FORMAT, step, d->rnd.step);
    int chained = d->sign.prev_step == (int64_t)d->rnd.step;
    if (chained)
        member_str(&b, "previous", d->sign.prev_hash);
    else
        sb_str(&b, ",\"previous\":null");
    member_str(&b, "origin", "round");
    /* the step's inputs beside the deltas: the previous step's outputs, as its record names them (a
     * verifier checks the files it is given against them) */
    if (chained && d->sign.prev_out[0][0] != '\0') {
        static const char *const names[3] = {"global", "momentum", "accumulator"};
        sb_str(&b, ",\"base\":{");
        for (int i = 0; i < 3; i++) {
            sb_printf(&b, "%s\"%s\":", i ? "," : "", names[i]);
            if (d->sign.prev_out[i][0] != '\0')
                sb_printf(&b, "\"%s\"", d->sign.prev_out[i]);
            else
                sb_str(&b, "null");
        }
        sb_str(&b, "}");
    } else {
        sb_str(&b, ",\"base\":null");
    }
    sb_str(&b, ",\"aggregator\":{\"id\":");
    sb_json_string(&b, d->cfg->id, strlen(d->cfg->id));
    member_str(&b, "key_fingerprint", d->sign.key.fingerprint);
    sb_str(&b, "}");
    config_json(&b, d, daemon__async(d) ? &d->agg.dn : NULL);
    /* the aggregated inputs in the pass's order (a verifier's order), then the quarantined, then the
     * deltas refused at their arrival for this step */
    sb_str(&b, ",\"inputs\":[");
    for (size_t k = 0; k < d->agg.n; k++, first = 0)
        entry_json(&b, d, d->agg.entry[k], first, scales != NULL ? &scales[k] : NULL);
    for (size_t i = 0; i < d->rnd.n; i++)
        if (d->rnd.entries[i].quarantined) {
            entry_json(&b, d, i, first, NULL);
            first = 0;
        }
    for (size_t i = 0; i < d->sign.nrefused; i++, first = 0) {
        const sign_refusal *r = &d->sign.refused[i];
        input_head(&b, first, r->node_id, r->base, r->local_step, 0);
        sb_str(&b, ",\"block_hash\":null");
        member_str(&b, "verdict", r->verdict);
        member_str(&b, "reason", r->reason);
        sb_str(&b, "}");
    }
    sb_str(&b, "]}");
    return sb_take(&b);
}

void daemon__sign_round_committed(dilocod *d)
{
    d->sign.nrefused = 0;       /* the next round's refusals start */
    /* the committed round's hashes are in its record; async's queued deltas keep theirs */
    for (size_t i = 0; i < d->sign.nknown;) {
        int used = 0;
        for (size_t k = 0; k < d->rnd.n && !used; k++)
            used = strcmp(d->rnd.entries[k].path, d->sign.known[i].path) == 0;
        if (used)
            known_forget(d, i);
        else
            i++;
    }
}

/* ---- a step entered whole -------------------------------------------------------------------------- */

int daemon__sign_whole(const dilocod *d, uint64_t step, const char *origin, const char *global_path,
                       char hash[MANIFEST_HASH_HEX], dl_error *err)
{
    manifest_output out = {"global", "global/latest.safetensors", global_path};
    sbuf b = {0};
    char *text;
    int rc;

    sb_printf(&b, "{\"format\":%d,\"algorithm\":\"dumb_diloco\",\"outer_step\":%" PRIu64 ",\"base_outer_step\":null"
              ",\"previous\":null", MANIFEST_FORMAT, step);
    member_str(&b, "origin", origin);
    sb_str(&b, ",\"aggregator\":{\"id\":");
    sb_json_string(&b, d->cfg->id, strlen(d->cfg->id));
    member_str(&b, "key_fingerprint", d->sign.key.fingerprint);
    sb_str(&b, "}");
    config_json(&b, d, NULL);
    sb_str(&b, ",\"inputs\":[]}");
    if ((text = sb_take(&b)) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    /* durable at once: the step's commit (outer_metadata.json) follows, and nothing recomputes this one */
    if ((rc = manifest_write(d->st.dir, step, text, &out, 1, &d->sign.key, hash, err)) == 0)
        rc = manifest_sync(d->st.dir, step, err);
    free(text);
    return rc;
}
