#include "store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cJSON.h>

#include "delta.h"
#include "fsutil.h"
#include "st_index.h"
#include "stepcount.h"
#include "strbuf.h"

static char *path_fmt(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *path_fmt(const char *fmt, ...)
{
    va_list ap;
    char *out = NULL;

    va_start(ap, fmt);
    if (vasprintf(&out, fmt, ap) < 0)
        out = NULL;
    va_end(ap);
    return out;
}

char *store_global_path(const store *s, uint64_t step)
{
    return path_fmt("%s/global/latest-%" PRIu64 ".safetensors", s->dir, step);
}

char *store_set_dir(const store *s, uint64_t step)
{
    return path_fmt("%s/global/set-%" PRIu64, s->dir, step);
}

char *store_momentum_path(const store *s, uint64_t step)
{
    return path_fmt("%s/outer_state-%" PRIu64 ".safetensors", s->dir, step);
}

char *store_accum_path(const store *s, uint64_t step)
{
    return path_fmt("%s/outer_accum-%" PRIu64 ".safetensors", s->dir, step);
}

const char *store_dn_variant_name(int paper)
{
    return paper ? "paper" : "forgather";
}

/* The "dn" object of outer_metadata.json and of the redo record (with_weight: the redo's). */
static void dn_json(sbuf *b, const store_dn *dn, int with_weight)
{
    char num[160];

    snprintf(num, sizeof(num), "{\"period\": %u, \"k\": %u, \"variant\": \"%s\", \"c\": %.17g", dn->period, dn->k,
             store_dn_variant_name(dn->paper), dn->c);
    sb_str(b, num);
    if (with_weight) {
        snprintf(num, sizeof(num), ", \"weight\": %.17g", dn->weight);
        sb_str(b, num);
    }
    sb_str(b, "}");
}

/* Reads a "dn" object: 0 (absent: dn->on 0), -1 when damaged. */
static int dn_parse(const cJSON *v, store_dn *dn, int with_weight)
{
    const cJSON *per, *k, *var, *c, *w;

    memset(dn, 0, sizeof(*dn));
    if (v == NULL || cJSON_IsNull(v))
        return 0;
    per = cJSON_GetObjectItemCaseSensitive(v, "period");
    k = cJSON_GetObjectItemCaseSensitive(v, "k");
    var = cJSON_GetObjectItemCaseSensitive(v, "variant");
    c = cJSON_GetObjectItemCaseSensitive(v, "c");
    w = cJSON_GetObjectItemCaseSensitive(v, "weight");
    if (!cJSON_IsNumber(per) || per->valuedouble < 1 || per->valuedouble > 1e6 ||
        per->valuedouble != (double)(unsigned)per->valuedouble || !cJSON_IsNumber(k) || k->valuedouble < 0 ||
        k->valuedouble > 1e6 || k->valuedouble != (double)(unsigned)k->valuedouble || !cJSON_IsString(var) ||
        (strcmp(var->valuestring, "paper") != 0 && strcmp(var->valuestring, "forgather") != 0) ||
        !cJSON_IsNumber(c) || !(c->valuedouble >= 0 && c->valuedouble <= 1) ||
        (with_weight && (!cJSON_IsNumber(w) || !(w->valuedouble > 0 && w->valuedouble <= 1))))
        return -1;
    dn->on = 1;
    dn->period = (unsigned)per->valuedouble;
    dn->k = (unsigned)k->valuedouble;
    dn->paper = var->valuestring[0] == 'p';
    dn->c = c->valuedouble;
    dn->weight = with_weight ? w->valuedouble : 0;
    return 0;
}

char *store_cache_root(const store *s)
{
    return path_fmt("%s/cache/deltas", s->dir);
}

char *store_cache_dir(const store *s, uint64_t step)
{
    return path_fmt("%s/cache/deltas/s%" PRIu64, s->dir, step);
}

char *store_incoming_dir(const store *s)
{
    return store_path_incoming(s->dir);
}

char *store_path_state_dir(const char *state_root, const char *id)
{
    return path_fmt("%s/%s", state_root, id);
}

char *store_path_metadata(const char *state_dir)
{
    return path_fmt("%s/outer_metadata.json", state_dir);
}

char *store_path_verdicts(const char *state_dir)
{
    return path_fmt("%s/verdicts.json", state_dir);
}

char *store_path_manifest_dir(const char *state_dir)
{
    return path_fmt("%s/rounds", state_dir);
}

char *store_path_manifest(const char *state_dir, uint64_t step, int sig)
{
    return path_fmt("%s/rounds/%" PRIu64 ".json%s", state_dir, step, sig ? ".sig" : "");
}

char *store_path_verify_dir(const char *state_dir)
{
    return path_fmt("%s/verify", state_dir);
}

char *store_path_verify_step(const char *state_dir, uint64_t step)
{
    return path_fmt("%s/verify/%" PRIu64, state_dir, step);
}

char *store_path_incoming(const char *state_dir)
{
    return path_fmt("%s/cache/incoming", state_dir);
}

char *store_path_incoming_file(const char *state_dir, const char *fmt, ...)
{
    va_list ap;
    char *name = NULL, *path;

    va_start(ap, fmt);
    if (vasprintf(&name, fmt, ap) < 0)
        name = NULL;
    va_end(ap);
    if (name == NULL)
        return NULL;
    path = path_fmt("%s/cache/incoming/%s", state_dir, name);
    free(name);
    return path;
}

char *store_path_cached_delta(const char *state_dir, uint64_t base_step, const char *node_id, uint64_t local_step)
{
    return path_fmt("%s/cache/deltas/s%" PRIu64 "/%s/delta_%" PRIu64 ".safetensors", state_dir, base_step, node_id,
                    local_step);
}

char *store_path_cached_index(const char *state_dir, uint64_t base_step, const char *node_id, uint64_t local_step)
{
    return path_fmt("%s/cache/deltas/s%" PRIu64 "/%s/delta_%" PRIu64 ST_INDEX_SUFFIX, state_dir, base_step, node_id,
                    local_step);
}

static char *read_small_file(const char *path, size_t max, dl_error *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat sb;
    char *buf;

    if (fd < 0) {
        dl_fail_errno(err, errno, "cannot open %s", path);
        return NULL;
    }
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size > max) {
        close(fd);
        dl_fail(err, DL_E_IO, NULL, 0, "%s is not a regular file of at most %zu bytes", path, max);
        return NULL;
    }
    buf = malloc((size_t)sb.st_size + 1);
    if (buf == NULL || fsu_pread_all(fd, buf, (size_t)sb.st_size, 0) != 0) {
        free(buf);
        close(fd);
        dl_fail(err, DL_E_IO, NULL, 0, "cannot read %s", path);
        return NULL;
    }
    buf[sb.st_size] = '\0';
    close(fd);
    return buf;
}

int store_read_verdicts(const char *state_dir, size_t max, char **text, size_t *len, dl_error *err)
{
    char *path = store_path_verdicts(state_dir);
    int rc = 0;

    *text = NULL;
    *len = 0;
    if (path == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if (access(path, F_OK) != 0 && errno == ENOENT)
        rc = 1;
    else if ((*text = read_small_file(path, max, err)) == NULL)
        rc = -DL_E_IO;
    else
        *len = strlen(*text);   /* a NUL inside is not JSON: the parse stops there and refuses it */
    free(path);
    return rc;
}

/* A version as text, "dev:ino:size:mtime_ns:ctime_ns:sum" (sum "-" when none): a string, as inode numbers
 * and nanosecond times go past what a JSON number keeps exactly. */
static void ident_text(char *buf, size_t cap, const fsu_ident *v)
{
    char sum[17] = "-";

    if (v->has_sum)
        ck_format(v->sum, sum);
    snprintf(buf, cap, "\"%" PRIu64 ":%" PRIu64 ":%" PRIu64 ":%" PRId64 ":%" PRId64 ":%s\"", v->dev, v->ino, v->size,
             v->mtime_ns, v->ctime_ns, sum);
}

/* ident_text's form read back (without the quotes), or the four fields of a record written before
 * ctime and the checksum were kept (ctime unknown, no checksum): 0, or -1 when it is neither exactly. */
static int ident_parse(const char *text, fsu_ident *x)
{
    char sum[17];
    int used = 0;

    memset(x, 0, sizeof(*x));
    x->ctime_ns = FSU_CTIME_UNKNOWN;
    if (sscanf(text, "%" SCNu64 ":%" SCNu64 ":%" SCNu64 ":%" SCNd64 "%n", &x->dev, &x->ino, &x->size, &x->mtime_ns,
               &used) != 4)
        return -1;
    if (text[used] == '\0')
        return 0;
    text += used;
    used = 0;
    if (sscanf(text, ":%" SCNd64 ":%16[-0-9a-f]%n", &x->ctime_ns, sum, &used) != 2 || text[used] != '\0' ||
        x->ctime_ns == FSU_CTIME_UNKNOWN)
        return -1;
    if (strcmp(sum, "-") == 0)
        return 0;
    x->has_sum = 1;
    return ck_parse(sum, &x->sum);
}

/* An optional checksum field of outer_metadata.json: 0 (absent or valid), -1 when damaged. */
static int sum_field(const cJSON *root, const char *name, int *have, uint64_t *sum)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);

    *have = 0;
    if (v == NULL || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsString(v) || ck_parse(v->valuestring, sum) != 0)
        return -1;
    *have = 1;
    return 0;
}

/* The "round" record of outer_metadata.json or redo.json (root's member round, an object), as text: the
 * raw text of the file when it is the last member as we write it (`"round": {...}` then `}`), checked to
 * parse alone as an object; else printed again by cJSON.  Raw, because cJSON prints a double with 15
 * digits when those come "close enough" back, and a record's weight keeps all 17 (history.h).  NULL when
 * out of memory. */
static char *round_text(const char *text, const cJSON *round)
{
    static const char key[] = "\n  \"round\": ";
    const char *at = NULL, *p = text, *end;

    while ((p = strstr(p, key)) != NULL)
        at = p++;
    if (at != NULL && (end = strrchr(text, '}')) != NULL && end > at + sizeof(key) - 1) {
        const char *v = at + sizeof(key) - 1;
        while (end > v && (end[-1] == '\n' || end[-1] == ' '))
            end--;
        char *raw = strndup(v, (size_t)(end - v));
        cJSON *o = raw != NULL ? cJSON_Parse(raw) : NULL;
        int ok = cJSON_IsObject(o);
        cJSON_Delete(o);
        if (ok)
            return raw;
        free(raw);
    }
    return cJSON_PrintUnformatted(round);
}

/* The metadata file is ours, but a damaged or hand-edited one must not crash us: validate it. */
static int load_metadata(store *s, const char *path, dl_error *err)
{
    char *text = read_small_file(path, 1 << 20, err);
    cJSON *root, *step, *g, *m, *b, *round, *gv;
    int rc = 0;

    if (text == NULL)
        return -DL_E_IO;
    root = cJSON_Parse(text);
    step = cJSON_GetObjectItemCaseSensitive(root, "outer_step");
    g = cJSON_GetObjectItemCaseSensitive(root, "global_file");
    m = cJSON_GetObjectItemCaseSensitive(root, "outer_state_file");
    b = cJSON_GetObjectItemCaseSensitive(root, "bootstrap");
    if (!cJSON_IsNumber(step) || step->valuedouble < 0 || step->valuedouble > 9007199254740991.0 ||
        step->valuedouble != (double)(uint64_t)step->valuedouble || !cJSON_IsString(g) ||
        (m != NULL && !cJSON_IsString(m) && !cJSON_IsNull(m))) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (outer_step, global_file)", path);
        goto out;
    }
    s->step = (uint64_t)step->valuedouble;
    s->global_path = store_global_path(s, s->step);
    /* the recorded names must be the ones this step implies: never follow a path from the file */
    char expect[64];
    snprintf(expect, sizeof(expect), "global/latest-%" PRIu64 ".safetensors", s->step);
    if (strcmp(g->valuestring, expect) != 0) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s names %s for step %" PRIu64 ", expected %s", path,
                     g->valuestring, s->step, expect);
        goto out;
    }
    if (cJSON_IsString(m)) {
        snprintf(expect, sizeof(expect), "outer_state-%" PRIu64 ".safetensors", s->step);
        if (strcmp(m->valuestring, expect) != 0) {
            rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s names %s for step %" PRIu64 ", expected %s", path,
                         m->valuestring, s->step, expect);
            goto out;
        }
        s->momentum_path = store_momentum_path(s, s->step);
    }
    s->bootstrap = cJSON_IsTrue(b);
    gv = cJSON_GetObjectItemCaseSensitive(root, "global_version");
    if (gv != NULL && !cJSON_IsNull(gv)) {
        if (!cJSON_IsString(gv) || ident_parse(gv->valuestring, &s->global_version) != 0) {
            rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (global_version)", path);
            goto out;
        }
        s->global_guarded = 1;
    }
    if (sum_field(root, "global_checksum", &s->global_summed, &s->global_sum) != 0 ||
        sum_field(root, "momentum_checksum", &s->momentum_summed, &s->momentum_sum) != 0 ||
        (s->momentum_summed && s->momentum_path == NULL)) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (global_checksum, momentum_checksum)", path);
        goto out;
    }
    const cJSON *acc = cJSON_GetObjectItemCaseSensitive(root, "accum_file");
    if (dn_parse(cJSON_GetObjectItemCaseSensitive(root, "dn"), &s->dn, 0) != 0 ||
        (acc != NULL && !cJSON_IsNull(acc) && !cJSON_IsString(acc))) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (dn, accum_file)", path);
        goto out;
    }
    if (cJSON_IsString(acc)) {
        snprintf(expect, sizeof(expect), "outer_accum-%" PRIu64 ".safetensors", s->step);
        if (strcmp(acc->valuestring, expect) != 0 || !s->dn.on) {
            rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s names %s for step %" PRIu64 ", expected %s", path,
                         acc->valuestring, s->step, expect);
            goto out;
        }
        s->accum_path = store_accum_path(s, s->step);
    }
    if (sum_field(root, "accum_checksum", &s->accum_summed, &s->accum_sum) != 0 ||
        (s->accum_summed && s->accum_path == NULL)) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (accum_checksum)", path);
        goto out;
    }
    if (store__view_parse(s, cJSON_GetObjectItemCaseSensitive(root, "view")) != 0) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (view)", path);
        goto out;
    }
    round = cJSON_GetObjectItemCaseSensitive(root, "round");
    if (cJSON_IsObject(round))
        s->round_json = round_text(text, round);       /* NULL on OOM: history only */
    s->committed = 1;
    if (access(s->global_path, R_OK) != 0 || (s->momentum_path && access(s->momentum_path, R_OK) != 0) ||
        (s->accum_path && access(s->accum_path, R_OK) != 0) || (s->view_path && access(s->view_path, R_OK) != 0))
        rc = dl_fail(err, DL_E_IO, NULL, 0, "committed step %" PRIu64 " is missing its files (%s)", s->step,
                     s->global_path);
out:
    cJSON_Delete(root);
    free(text);
    return rc;
}

int store_open(store *s, const char *state_root, const char *id, dl_error *err)
{
    char *meta = NULL, *sub = NULL;
    int rc;

    memset(s, 0, sizeof(*s));
    s->dir = store_path_state_dir(state_root, id);
    if (s->dir == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    static const char *const subdirs[] = {"global", "cache/deltas", "cache/incoming"};
    for (size_t i = 0; i < 3; i++) {
        sub = path_fmt("%s/%s", s->dir, subdirs[i]);
        if (sub == NULL)
            return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        rc = fsu_mkdirs(sub, err);
        free(sub);
        if (rc != 0)
            return rc;
    }
    /* the key first: the checksums of the committed step are under it */
    char *key = path_fmt("%s/checksum.key", s->dir);
    if (key == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    rc = ck_key_load(key, &s->key, err);
    free(key);
    if (rc != 0)
        return rc;
    meta = store_path_metadata(s->dir);
    if (meta == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    rc = access(meta, F_OK) == 0 ? load_metadata(s, meta, err) : 0;
    free(meta);
    return rc;
}

static void iso_now(char *out, size_t size)
{
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(out, size, "%Y-%m-%dT%H:%M:%S+00:00", &tm);
}

int store_commit_write(const store *s, const store_commit_info *info, dl_error *err)
{
    sbuf b = {0};
    char when[40], num[128], *meta, *text;
    int rc;

    /* the guard at the commit: a step past STEPCOUNT_STEP_MAX would brick the state (its deltas could
     * not name it, a restart could not read it back) */
    if ((rc = stepcount_check(info->step, "step", err)) != 0)
        return rc;
    iso_now(when, sizeof(when));
    sb_str(&b, "{\n  \"format\": 1,\n  \"outer_step\": ");
    sb_u64(&b, info->step);
    sb_str(&b, ",\n  \"global_file\": ");
    snprintf(num, sizeof(num), "global/latest-%" PRIu64 ".safetensors", info->step);
    sb_json_string(&b, num, strlen(num));
    sb_str(&b, ",\n  \"outer_state_file\": ");
    if (info->momentum_path != NULL) {
        snprintf(num, sizeof(num), "outer_state-%" PRIu64 ".safetensors", info->step);
        sb_json_string(&b, num, strlen(num));
    } else {
        sb_str(&b, "null");
    }
    sb_str(&b, ",\n  \"optimizer\": ");
    sb_json_string(&b, info->optimizer, strlen(info->optimizer));
    snprintf(num, sizeof(num), ",\n  \"lr\": %.17g,\n  \"momentum\": %.17g", info->lr, info->momentum);
    sb_str(&b, num);
    sb_str(&b, ",\n  \"bootstrap\": ");
    sb_str(&b, info->bootstrap ? "true" : "false");
    sb_str(&b, ",\n  \"origin\": ");
    sb_json_string(&b, info->origin, strlen(info->origin));
    sb_str(&b, ",\n  \"updated_at\": ");
    sb_json_string(&b, when, strlen(when));
    if (info->global_version != NULL) {
        sb_str(&b, ",\n  \"global_version\": ");
        ident_text(num, sizeof(num), info->global_version);
        sb_str(&b, num);
    }
    if (info->global_sum != NULL) {
        char sum[17];
        ck_format(*info->global_sum, sum);
        sb_str(&b, ",\n  \"global_checksum\": ");
        sb_json_string(&b, sum, 16);
    }
    if (info->momentum_sum != NULL) {
        char sum[17];
        ck_format(*info->momentum_sum, sum);
        sb_str(&b, ",\n  \"momentum_checksum\": ");
        sb_json_string(&b, sum, 16);
    }
    if (info->dn != NULL && info->dn->on) {
        sb_str(&b, ",\n  \"dn\": ");
        dn_json(&b, info->dn, 0);
        sb_str(&b, ",\n  \"accum_file\": ");
        if (info->accum_path != NULL) {
            snprintf(num, sizeof(num), "outer_accum-%" PRIu64 ".safetensors", info->step);
            sb_json_string(&b, num, strlen(num));
        } else {
            sb_str(&b, "null");
        }
        if (info->accum_path != NULL && info->accum_sum != NULL) {
            char sum[17];
            ck_format(*info->accum_sum, sum);
            sb_str(&b, ",\n  \"accum_checksum\": ");
            sb_json_string(&b, sum, 16);
        }
    }
    if (info->view != NULL)
        store__view_json(&b, info->view);
    if (info->round_json != NULL) {
        sb_str(&b, ",\n  \"round\": ");
        sb_add(&b, info->round_json, strcspn(info->round_json, "\n"));
    }
    sb_str(&b, "\n}\n");
    size_t len = b.len;
    if ((text = sb_take(&b)) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    meta = store_path_metadata(s->dir);
    if (meta == NULL) {
        free(text);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    rc = fsu_write_atomic(meta, text, len, err);
    free(meta);
    free(text);
    return rc;
}

int store_commit_apply(store *s, const store_commit_info *info)
{
    char *g = strdup(info->global_path);
    char *m = info->momentum_path ? strdup(info->momentum_path) : NULL;
    char *r = info->round_json ? strdup(info->round_json) : NULL;
    char *a = info->accum_path ? strdup(info->accum_path) : NULL;

    if (g == NULL || (info->momentum_path && m == NULL) || (info->round_json && r == NULL) ||
        (info->accum_path && a == NULL) || store__view_apply(s, info) != 0) {
        free(g);
        free(m);
        free(r);
        free(a);
        return -DL_E_NO_MEMORY;
    }
    free(s->global_path);
    free(s->momentum_path);
    free(s->round_json);
    free(s->accum_path);
    s->global_path = g;
    s->momentum_path = m;
    s->accum_path = a;
    if (info->dn != NULL)
        s->dn = *info->dn;
    else
        memset(&s->dn, 0, sizeof(s->dn));
    s->dn.weight = 0;
    s->accum_summed = info->accum_path != NULL && info->accum_sum != NULL;
    s->accum_sum = s->accum_summed ? *info->accum_sum : 0;
    s->round_json = r;
    s->step = info->step;
    s->bootstrap = info->bootstrap;
    s->global_guarded = info->global_version != NULL;
    if (info->global_version != NULL)
        s->global_version = *info->global_version;
    s->global_summed = info->global_sum != NULL;
    s->global_sum = info->global_sum != NULL ? *info->global_sum : 0;
    s->momentum_summed = info->momentum_sum != NULL;
    s->momentum_sum = info->momentum_sum != NULL ? *info->momentum_sum : 0;
    s->committed = 1;
    return 0;
}

int store_global_intact(const store *s)
{
    if (!s->committed || !s->global_guarded)
        return 1;
    int rc = fsu_ident_check(s->global_path, &s->global_version);
    return rc == FSU_IDENT_CTIME_MOVED ? 1 : rc;
}

int store_commit(store *s, const store_commit_info *info, dl_error *err)
{
    int rc = store_commit_write(s, info, err);
    if (rc == 0 && store_commit_apply(s, info) != 0)
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    return rc;
}

/* ---- the redo record ------------------------------------------------------------------------------ */

/* outer.h's outer_rule, in its order */
static const char *const rule_names[] = {"mean", "weighted_mean", "clipped_mean", "trimmed_mean", "median"};

/* The redo record's "aggregate": {"rule", "k", "scales"} (absent: mean). */
static void aggregate_json(sbuf *b, const store_redo *r)
{
    char num[64];

    if (r->rule <= 0 || (size_t)r->rule >= sizeof(rule_names) / sizeof(rule_names[0]))
        return;
    snprintf(num, sizeof(num), ",\n  \"aggregate\": {\"rule\": \"%s\", \"k\": %u", rule_names[r->rule], r->trim_k);
    sb_str(b, num);
    if (r->scales != NULL) {
        sb_str(b, ", \"scales\": [");
        for (size_t i = 0; i < r->ndeltas; i++) {
            snprintf(num, sizeof(num), "%s%.9g", i ? ", " : "", (double)r->scales[i]);
            sb_str(b, num);
        }
        sb_str(b, "]");
    }
    sb_str(b, "}");
}

/* The redo record's "aggregate", read back: its rule, K, and one finite scale per delta. */
static int aggregate_parse(const cJSON *a, store_redo *r)
{
    const cJSON *rule, *k, *scales, *e;
    size_t i = 0;

    if (a == NULL)
        return 0;
    rule = cJSON_GetObjectItemCaseSensitive(a, "rule");
    k = cJSON_GetObjectItemCaseSensitive(a, "k");
    scales = cJSON_GetObjectItemCaseSensitive(a, "scales");
    if (!cJSON_IsObject(a) || !cJSON_IsString(rule) || !cJSON_IsNumber(k) || !(k->valuedouble >= 0) ||
        k->valuedouble > 1e6)
        return -1;
    r->rule = -1;
    for (size_t n = 1; n < sizeof(rule_names) / sizeof(rule_names[0]); n++)
        if (strcmp(rule->valuestring, rule_names[n]) == 0)
            r->rule = (int)n;
    if (r->rule < 0)
        return -1;
    r->trim_k = (unsigned)k->valuedouble;
    if (scales == NULL)
        return 0;
    if (!cJSON_IsArray(scales) || (size_t)cJSON_GetArraySize(scales) != r->ndeltas ||
        (r->scales = calloc(r->ndeltas ? r->ndeltas : 1, sizeof(*r->scales))) == NULL)
        return -1;
    cJSON_ArrayForEach(e, scales) {
        if (!cJSON_IsNumber(e) || !isfinite(e->valuedouble))
            return -1;
        r->scales[i++] = (float)e->valuedouble;
    }
    return 0;
}

int store_redo_write(const store *s, const store_redo *r, dl_error *err)
{
    sbuf b = {0};
    char num[160], *path, *text;
    size_t dl = strlen(s->dir);
    int rc;

    snprintf(num, sizeof(num), "{\n  \"format\": 1,\n  \"step\": %" PRIu64 ",\n  \"base_step\": %" PRIu64, r->step,
             r->base);
    sb_str(&b, num);
    sb_str(&b, ",\n  \"optimizer\": ");
    sb_json_string(&b, r->optimizer, strlen(r->optimizer));
    snprintf(num, sizeof(num), ",\n  \"lr\": %.17g,\n  \"momentum\": %.17g,\n  \"deltas\": [", r->lr, r->momentum);
    sb_str(&b, num);
    for (size_t i = 0; i < r->ndeltas; i++) {
        const char *rel = r->deltas[i];
        if (strncmp(rel, s->dir, dl) == 0 && rel[dl] == '/')
            rel += dl + 1;      /* relative to the state directory: the tree may be moved as a whole */
        sb_str(&b, i ? ", " : "");
        sb_json_string(&b, rel, strlen(rel));
    }
    sb_str(&b, "],\n  \"versions\": [");
    for (size_t i = 0; i < r->ndeltas; i++) {
        sb_str(&b, i ? ", " : "");
        if (r->guarded == NULL || !r->guarded[i]) {
            sb_str(&b, "null");
            continue;
        }
        ident_text(num, sizeof(num), &r->versions[i]);
        sb_str(&b, num);
    }
    sb_str(&b, "]");
    if (r->dn.on) {
        sb_str(&b, ",\n  \"async\": ");
        dn_json(&b, &r->dn, 1);
    }
    aggregate_json(&b, r);
    if (r->downlink != 0) {
        sb_str(&b, ",\n  \"downlink\": ");
        sb_json_string(&b, store_redo_downlink_name(r->downlink), strlen(store_redo_downlink_name(r->downlink)));
    }
    sb_str(&b, ",\n  \"round\": ");
    if (r->round_json != NULL)
        sb_add(&b, r->round_json, strcspn(r->round_json, "\n"));
    else
        sb_str(&b, "null");
    if (r->manifest != NULL) {
        sb_str(&b, ",\n  \"manifest\": ");
        sb_json_string(&b, r->manifest, strlen(r->manifest));
    }
    sb_str(&b, "\n}\n");
    size_t len = b.len;
    if ((text = sb_take(&b)) == NULL || (path = path_fmt("%s/redo.json", s->dir)) == NULL) {
        free(text);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    rc = fsu_write_atomic(path, text, len, err);
    free(path);
    free(text);
    return rc;
}

/* A delta path of the redo record: cache/deltas/s<base>/<node>/delta_<n>.safetensors (or
 * delta_<n>.safetensors.index.json), nothing else. */
static int redo_delta_ok(const char *rel, uint64_t base, int async)
{
    char prefix[64], node[DELTA_NODE_ID_MAX + 1], as_hub[300];
    const char *p, *slash;
    delta_path dp;

    if (async) {
        /* an update's deltas are of any committed base up to its own (async mode) */
        const char *dir = "cache/deltas/s", *digits = rel + strlen(dir), *end;
        uint64_t b;
        if (strncmp(rel, dir, strlen(dir)) != 0 || (end = strchr(digits, '/')) == NULL ||
            delta_parse_int(digits, (size_t)(end - digits), &b) != 0 || b > base)
            return 0;
        p = end + 1;
    } else {
        snprintf(prefix, sizeof(prefix), "cache/deltas/s%" PRIu64 "/", base);
        if (strncmp(rel, prefix, strlen(prefix)) != 0)
            return 0;
        p = rel + strlen(prefix);
    }
    if ((slash = strchr(p, '/')) == NULL || (size_t)(slash - p) > DELTA_NODE_ID_MAX)
        return 0;
    memcpy(node, p, (size_t)(slash - p));
    node[slash - p] = '\0';
    if (!delta_valid_node_id(node, strlen(node)))
        return 0;
    /* the file name follows the Hub path rules (no further '/', delta_<n>.safetensors) */
    if (snprintf(as_hub, sizeof(as_hub), "nodes/%s", p) >= (int)sizeof(as_hub))
        return 0;
    /* a single file or the index of a set (its shards sit next to it and are opened through it) */
    return delta_parse_any_path(as_hub, &dp, NULL) == 0 && dp.kind != DELTA_PATH_SHARD;
}

static int json_u64(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 9007199254740991.0 ||
        v->valuedouble != (double)(uint64_t)v->valuedouble)
        return -1;
    *out = (uint64_t)v->valuedouble;
    return 0;
}

/* "versions": one entry per delta, null or ident_text's form (absent in older records). */
static int read_versions(store_redo *r, const cJSON *v, const char *path, dl_error *err)
{
    const cJSON *e;
    size_t i = 0;

    if (v == NULL)
        return 0;
    if (!cJSON_IsArray(v) || (size_t)cJSON_GetArraySize(v) != r->ndeltas)
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s: versions do not match the deltas", path);
    if ((r->guarded = calloc(r->ndeltas, 1)) == NULL || (r->versions = calloc(r->ndeltas, sizeof(*r->versions))) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    cJSON_ArrayForEach(e, v) {
        if (cJSON_IsString(e)) {
            if (ident_parse(e->valuestring, &r->versions[i]) != 0)
                return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s: a damaged version", path);
            r->guarded[i] = 1;
        } else if (!cJSON_IsNull(e)) {
            return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s: a damaged version", path);
        }
        i++;
    }
    return 0;
}

int store_redo_read(const store *s, store_redo *r, int *present, dl_error *err)
{
    char *path = path_fmt("%s/redo.json", s->dir), *text;
    cJSON *root = NULL, *d, *o, *lr, *mom, *round;
    int rc = 0;

    memset(r, 0, sizeof(*r));
    *present = 0;
    if (path == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if (access(path, F_OK) != 0) {
        free(path);
        return 0;
    }
    *present = 1;
    text = read_small_file(path, 16 << 20, err);
    if (text == NULL) {
        free(path);
        return -DL_E_IO;
    }
    root = cJSON_Parse(text);
    d = cJSON_GetObjectItemCaseSensitive(root, "deltas");
    o = cJSON_GetObjectItemCaseSensitive(root, "optimizer");
    lr = cJSON_GetObjectItemCaseSensitive(root, "lr");
    mom = cJSON_GetObjectItemCaseSensitive(root, "momentum");
    round = cJSON_GetObjectItemCaseSensitive(root, "round");
    if (json_u64(cJSON_GetObjectItemCaseSensitive(root, "step"), &r->step) != 0 ||
        json_u64(cJSON_GetObjectItemCaseSensitive(root, "base_step"), &r->base) != 0 || r->step != r->base + 1 ||
        !cJSON_IsArray(d) || !cJSON_IsString(o) || !cJSON_IsNumber(lr) || !cJSON_IsNumber(mom)) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (step, base_step, deltas, optimizer)", path);
        goto out;
    }
    r->ndeltas = (size_t)cJSON_GetArraySize(d);
    if (r->ndeltas == 0 || r->ndeltas > 1u << 16 || (r->deltas = calloc(r->ndeltas, sizeof(*r->deltas))) == NULL ||
        (r->optimizer = strdup(o->valuestring)) == NULL) {
        rc = dl_fail(err, r->ndeltas == 0 || r->ndeltas > 1u << 16 ? DL_E_METADATA_INVALID : DL_E_NO_MEMORY, NULL, 0,
                     "%s: %zu deltas", path, r->ndeltas);
        goto out;
    }
    r->lr = lr->valuedouble;
    r->momentum = mom->valuedouble;
    if (dn_parse(cJSON_GetObjectItemCaseSensitive(root, "async"), &r->dn, 1) != 0) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (async)", path);
        goto out;
    }
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, d) {
        if (!cJSON_IsString(e) || !redo_delta_ok(e->valuestring, r->base, r->dn.on)) {
            rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s names a delta that is not a cached delta of step %"
                         PRIu64, path, r->base);
            goto out;
        }
        if ((r->deltas[i++] = path_fmt("%s/%s", s->dir, e->valuestring)) == NULL) {
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            goto out;
        }
    }
    if ((rc = read_versions(r, cJSON_GetObjectItemCaseSensitive(root, "versions"), path, err)) != 0)
        goto out;
    if (aggregate_parse(cJSON_GetObjectItemCaseSensitive(root, "aggregate"), r) != 0) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (aggregate)", path);
        goto out;
    }
    if (store__redo_downlink_parse(cJSON_GetObjectItemCaseSensitive(root, "downlink"), &r->downlink) != 0) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (downlink)", path);
        goto out;
    }
    if (cJSON_IsObject(round) && (r->round_json = round_text(text, round)) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "manifest");
    if (m != NULL && !cJSON_IsNull(m) && (!cJSON_IsString(m) || m->valuestring[0] != '{')) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is damaged (manifest)", path);
        goto out;
    }
    if (cJSON_IsString(m) && (r->manifest = strdup(m->valuestring)) == NULL)
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
out:
    cJSON_Delete(root);
    free(text);
    free(path);
    if (rc != 0)
        store_redo_free(r);
    return rc;
}

int store_redo_remove(const store *s, dl_error *err)
{
    char *path = path_fmt("%s/redo.json", s->dir);
    int rc;

    if (path == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if (unlink(path) != 0 && errno != ENOENT)
        rc = dl_fail_errno(err, errno, "cannot remove %s", path);
    else
        rc = fsu_fsync_parent(path, err);
    free(path);
    return rc;
}

void store_redo_free(store_redo *r)
{
    for (size_t i = 0; r->deltas != NULL && i < r->ndeltas; i++)
        free(r->deltas[i]);
    free(r->deltas);
    free(r->guarded);
    free(r->versions);
    free(r->optimizer);
    free(r->round_json);
    free(r->scales);
    free(r->manifest);
    memset(r, 0, sizeof(*r));
}

/* rm -r of a directory tree we own (never follows symlinks). */
int store_remove_tree(const char *path)
{
    DIR *d = opendir(path);
    struct dirent *e;
    int rc = 0;

    if (d == NULL)
        return errno == ENOENT ? 0 : -errno;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        char *child = path_fmt("%s/%s", path, e->d_name);
        struct stat sb;
        if (child == NULL) {
            rc = -ENOMEM;
            break;
        }
        if (lstat(child, &sb) == 0 && S_ISDIR(sb.st_mode))
            rc = store_remove_tree(child);
        else if (unlink(child) != 0 && errno != ENOENT)
            rc = -errno;
        free(child);
    }
    closedir(d);
    if (rmdir(path) != 0 && errno != ENOENT)
        rc = -errno;
    return rc;
}

/* Calls fn(dir, name, arg) for the file of a delta path, or an index and every shard of its base. */
static int for_each_delta_file(const char *path, int (*fn)(const char *path, void *arg), void *arg)
{
    size_t n = strlen(path), sl = strlen(ST_INDEX_SUFFIX);
    const char *slash = strrchr(path, '/');
    char base[ST_INDEX_BASE_MAX + 1], b2[ST_INDEX_BASE_MAX + 1], *dir, *child;
    DIR *d;
    struct dirent *e;
    uint32_t i, of;
    int rc;

    if ((rc = fn(path, arg)) != 0 || n <= sl || strcmp(path + n - sl, ST_INDEX_SUFFIX) != 0 || slash == NULL ||
        (size_t)(path + n - sl - slash - 1) > ST_INDEX_BASE_MAX)
        return rc;
    memcpy(base, slash + 1, (size_t)(path + n - sl - slash - 1));
    base[path + n - sl - slash - 1] = '\0';
    if ((dir = strndup(path, (size_t)(slash - path))) == NULL)
        return -ENOMEM;
    if ((d = opendir(dir)) == NULL) {
        rc = errno == ENOENT ? 0 : -errno;
        free(dir);
        return rc;
    }
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (st_index_classify(e->d_name, strlen(e->d_name), b2, &i, &of) != ST_NAME_SHARD || strcmp(b2, base) != 0)
            continue;
        if ((child = path_fmt("%s/%s", dir, e->d_name)) == NULL)
            rc = -ENOMEM;
        else
            rc = fn(child, arg);
        free(child);
    }
    closedir(d);
    free(dir);
    return rc;
}

static int sync_one(const char *path, void *arg)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW), rc = 0;
    (void)arg;
    if (fd < 0)
        return -errno;
    if (fsync(fd) != 0)
        rc = -errno;
    close(fd);
    return rc;
}

int store_sync_delta(const char *path, dl_error *err)
{
    int rc = for_each_delta_file(path, sync_one, NULL);
    if (rc != 0)
        return dl_fail_errno(err, -rc, "fsync of the cached delta %s", path);
    return 0;
}

static int unlink_one(const char *path, void *arg)
{
    (void)arg;
    return unlink(path) == 0 || errno == ENOENT ? 0 : -errno;
}

int store_remove_delta(const char *path)
{
    /* the index first (for_each_delta_file's order): a set without it is incomplete to everyone */
    return for_each_delta_file(path, unlink_one, NULL);
}

/* Parses "<prefix><digits><suffix>"; returns 0 and the number, or -1. */
static int match_step(const char *name, const char *prefix, const char *suffix, uint64_t *step)
{
    size_t pl = strlen(prefix), sl = strlen(suffix), nl = strlen(name);
    uint64_t v = 0;

    if (nl <= pl + sl || strncmp(name, prefix, pl) != 0 || strcmp(name + nl - sl, suffix) != 0)
        return -1;
    for (size_t i = pl; i < nl - sl; i++) {
        if (name[i] < '0' || name[i] > '9' || v > UINT64_MAX / 10)
            return -1;
        v = v * 10 + (uint64_t)(name[i] - '0');
    }
    *step = v;
    return 0;
}

static int is_temp(const char *name)
{
    return name[0] == '.' && strstr(name, ".tmp-") != NULL;
}

/* Removes entries of dir for which keep() says no. */
static int sweep(const char *dir, const store *s, int (*keep)(const store *, const char *))
{
    DIR *d = opendir(dir);
    struct dirent *e;
    int rc = 0;

    if (d == NULL)
        return errno == ENOENT ? 0 : -errno;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0 || keep(s, e->d_name))
            continue;
        char *child = path_fmt("%s/%s", dir, e->d_name);
        if (child == NULL) {
            rc = -ENOMEM;
            break;
        }
        struct stat sb;
        if (lstat(child, &sb) == 0 && S_ISDIR(sb.st_mode))
            rc = store_remove_tree(child);
        else if (unlink(child) != 0 && errno != ENOENT)
            rc = -errno;
        free(child);
    }
    closedir(d);
    return rc;
}

/* At startup nothing runs: everything but the committed step goes.  After a commit an aggregation
 * of the next step may already be writing its files: only older steps go. */
static int keep_global(const store *s, const char *name)
{
    uint64_t step;
    int view = store__keep_view(s, name, match_step);
    if (view >= 0)
        return view;
    if (match_step(name, "latest-", ".safetensors", &step) == 0 || match_step(name, "set-", "", &step) == 0)
        return s->committed && (s->startup ? step == s->step : step >= s->step);
    return !(s->startup && is_temp(name));      /* leave foreign files alone */
}

static int keep_top(const store *s, const char *name)
{
    uint64_t step;
    if (match_step(name, "outer_state-", ".safetensors", &step) == 0)
        return s->committed && (s->startup ? step == s->step && s->momentum_path != NULL : step >= s->step);
    if (match_step(name, "outer_accum-", ".safetensors", &step) == 0)
        return s->committed && (s->startup ? step == s->step && s->accum_path != NULL : step >= s->step);
    return !(s->startup && is_temp(name));
}

static int keep_cache(const store *s, const char *name)
{
    uint64_t step;
    if (match_step(name, "s", "", &step) == 0)
        return !s->committed || s->async_cache || step >= s->step;
    return !(s->startup && is_temp(name));
}

/* cache/incoming: partial downloads of a transport (hf-<oid>.part, s3-<...>.part, and the
 * directories of sharded sets being downloaded, hf-...set / s3-...set) resume after a restart; the
 * rest goes. */
static int keep_incoming(const store *s, const char *name)
{
    size_t n = strlen(name);
    (void)s;
    return (strncmp(name, "hf-", 3) == 0 || strncmp(name, "s3-", 3) == 0) && n > 8 &&
           (strcmp(name + n - 5, ".part") == 0 || strcmp(name + n - 4, ".set") == 0);
}

/* Async: a node directory of cache/deltas/s<k>/ (k before the committed step) that holds nothing goes,
 * under the node directory's lock that intake links under (intake_cache.c: it makes the directory again
 * when it finds its lock on a removed one), then s<k> itself when it is empty. */
static int sweep_empty_cache(const char *cache, uint64_t committed)
{
    DIR *d = opendir(cache);
    struct dirent *e;

    if (d == NULL)
        return errno == ENOENT ? 0 : -errno;
    while ((e = readdir(d)) != NULL) {
        uint64_t step;
        if (match_step(e->d_name, "s", "", &step) != 0 || step >= committed)
            continue;
        char *sdir = path_fmt("%s/%s", cache, e->d_name);
        DIR *nd = sdir != NULL ? opendir(sdir) : NULL;
        struct dirent *n;
        while (nd != NULL && (n = readdir(nd)) != NULL) {
            if (n->d_name[0] == '.')
                continue;
            char *node = path_fmt("%s/%s", sdir, n->d_name);
            int fd = node != NULL ? open(node, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : -1;
            if (fd >= 0 && flock(fd, LOCK_EX) == 0)
                (void)rmdir(node);      /* fails unless empty: nothing but an empty directory goes */
            if (fd >= 0)
                close(fd);
            free(node);
        }
        if (nd != NULL)
            closedir(nd);
        if (sdir != NULL)
            (void)rmdir(sdir);
        free(sdir);
    }
    closedir(d);
    return 0;
}

int store_cleanup(const store *st, int at_startup, dl_error *err)
{
    store view = *st;
    const store *s = &view;
    char *g = path_fmt("%s/global", s->dir), *c = path_fmt("%s/cache/deltas", s->dir);
    char *in = store_incoming_dir(s);
    int rc = 0;

    view.startup = at_startup;
    if (g == NULL || c == NULL || in == NULL)
        rc = -ENOMEM;
    if (rc == 0)
        rc = sweep(g, s, keep_global);
    if (rc == 0)
        rc = sweep(s->dir, s, keep_top);
    if (rc == 0)
        rc = sweep(c, s, keep_cache);
    if (rc == 0 && s->async_cache && s->committed)
        rc = sweep_empty_cache(c, s->step);
    if (rc == 0 && at_startup)
        rc = sweep(in, s, keep_incoming);
    free(g);
    free(c);
    free(in);
    if (rc != 0)
        return dl_fail_errno(err, -rc, "cleaning up %s", s->dir);
    return 0;
}

int store_remove_consumed(char *const *paths, size_t n, dl_error *err)
{
    for (size_t i = 0; i < n; i++) {
        int rc = store_remove_delta(paths[i]);
        if (rc != 0 && rc != -ENOENT)
            return dl_fail_errno(err, -rc, "cannot remove the consumed delta %s", paths[i]);
    }
    /* the removals durable before the redo record that names them goes (a crash between would apply them
     * again) */
    for (size_t i = 0; i < n; i++) {
        int rc = fsu_fsync_parent(paths[i], err);
        if (rc != 0 && err->sys_errno != ENOENT)
            return rc;
    }
    return 0;
}

void store_free(store *s)
{
    free(s->dir);
    free(s->global_path);
    free(s->accum_path);
    free(s->momentum_path);
    free(s->round_json);
    free(s->view_path);
    memset(s, 0, sizeof(*s));
}
