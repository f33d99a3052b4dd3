#include "delta.h"
#include "convert.h"
#include "kernel_clones.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Elements per chunk of streaming passes: 256 Ki elements keeps every buffer at 2 MiB or less. */
#define CHUNK_ELEMS (256u * 1024u)

int delta_valid_node_id(const char *s, size_t len)
{
    if (len == 0 || len > DELTA_NODE_ID_MAX)
        return 0;
    if ((len == 1 && s[0] == '.') || (len == 2 && s[0] == '.' && s[1] == '.'))
        return 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

int delta_parse_int(const char *s, size_t len, uint64_t *out)
{
    uint64_t v = 0;

    if (len == 0 || len > 16 || (len > 1 && s[0] == '0'))
        return -1;
    for (size_t i = 0; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        v = v * 10 + (uint64_t)(s[i] - '0');   /* 16 digits cannot overflow 64 bits */
    }
    if (v > DELTA_INT_MAX)
        return -1;
    *out = v;
    return 0;
}

int delta_parse_path(const char *path, char node_id[DELTA_NODE_ID_MAX + 1], uint64_t *local_step,
                     dl_error *err)
{
    static const char prefix[] = "nodes/", fprefix[] = "delta_", suffix[] = ".safetensors";
    size_t len = strlen(path);
    const char *id, *slash, *file;
    size_t id_len, file_len;

    if (len < sizeof(prefix) - 1 || memcmp(path, prefix, sizeof(prefix) - 1) != 0)
        goto bad;
    id = path + sizeof(prefix) - 1;
    slash = strchr(id, '/');
    if (slash == NULL)
        goto bad;
    id_len = (size_t)(slash - id);
    if (!delta_valid_node_id(id, id_len))
        return dl_fail(err, DL_E_INVALID_PATH, NULL, 0,
                       "invalid node id in delta path (allowed: [A-Za-z0-9._-]{1,64}, not . or ..)");
    file = slash + 1;
    file_len = strlen(file);
    if (strchr(file, '/') != NULL || file_len < sizeof(fprefix) - 1 + sizeof(suffix) - 1 ||
        memcmp(file, fprefix, sizeof(fprefix) - 1) != 0 ||
        memcmp(file + file_len - (sizeof(suffix) - 1), suffix, sizeof(suffix) - 1) != 0)
        goto bad;
    if (delta_parse_int(file + sizeof(fprefix) - 1,
                        file_len - (sizeof(fprefix) - 1) - (sizeof(suffix) - 1), local_step) != 0)
        return dl_fail(err, DL_E_INVALID_PATH, NULL, 0,
                       "invalid local step in delta path (a decimal integer without sign or leading zeros)");
    memcpy(node_id, id, id_len);
    node_id[id_len] = '\0';
    return 0;
bad:
    return dl_fail(err, DL_E_INVALID_PATH, NULL, 0,
                   "not a delta path: expected nodes/<node_id>/delta_<local_step>.safetensors");
}

int delta_floating_state(const st_header *h, const st_tensor ***out, size_t *n, dl_error *err)
{
    const st_tensor **v = malloc((h->ntensors ? h->ntensors : 1) * sizeof(*v));
    size_t k = 0;

    if (v == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t i = 0; i < h->ntensors; i++) {
        const st_tensor *t = &h->tensors[h->by_name[i]];
        if (st_dtype_is_floating(t->dtype))
            v[k++] = t;
    }
    *out = v;
    *n = k;
    return 0;
}

static int same_shape(const st_tensor *a, const st_tensor *b)
{
    return a->ndim == b->ndim && (a->ndim == 0 || memcmp(a->shape, b->shape, a->ndim * sizeof(uint64_t)) == 0);
}

static void shape_str(char *out, size_t size, const st_tensor *t)
{
    size_t o = 0;
    int w;

    out[0] = '\0';
    for (size_t i = 0; i <= t->ndim; i++) {
        if (i == t->ndim)
            w = snprintf(out + o, size - o, "]");
        else
            w = snprintf(out + o, size - o, "%s%llu", i ? ", " : "[", (unsigned long long)t->shape[i]);
        if (w < 0 || (size_t)w >= size - o)
            return;                     /* truncated: good enough for a message */
        o += (size_t)w;
    }
    if (t->ndim == 0)
        snprintf(out, size, "[]");
}

static int shape_mismatch(dl_error *err, const st_tensor *want, const st_tensor *got, const char *what)
{
    char a[128], b[128];
    shape_str(a, sizeof(a), want);
    shape_str(b, sizeof(b), got);
    return dl_fail(err, DL_E_SHAPE_MISMATCH, got->name, got->name_len, "%s has shape %s, expected %s",
                   what, b, a);
}

/* Linear: a delta carries a handful of metadata keys. */
static const char *meta_find(const st_meta *meta, size_t n, const char *key, size_t *len)
{
    size_t kl = strlen(key);
    for (size_t i = 0; i < n; i++) {
        if (meta[i].key_len == kl && memcmp(meta[i].key, key, kl) == 0) {
            if (len != NULL)
                *len = meta[i].value_len;
            return meta[i].value;
        }
    }
    return NULL;
}

int delta_valid_metric_name(const char *s, size_t len)
{
    if (len == 0 || len > DELTA_METRIC_NAME_MAX)
        return 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'))
            return 0;
    }
    return 1;
}

static size_t digits(const char *s, size_t i, size_t len)
{
    size_t j = i;
    while (j < len && s[j] >= '0' && s[j] <= '9')
        j++;
    return j - i;
}

int delta_parse_metric_value(const char *s, size_t len, double *out)
{
    char buf[DELTA_METRIC_VALUE_MAX + 1];
    size_t i = 0, k;
    char *end;
    double v;

    if (len == 0 || len > DELTA_METRIC_VALUE_MAX)
        return -1;
    /* the grammar first: strtod alone would take hex, inf, nan, spaces and a locale's decimal mark */
    if (s[i] == '-')
        i++;
    if ((k = digits(s, i, len)) == 0)
        return -1;
    i += k;
    if (i < len && s[i] == '.') {
        if ((k = digits(s, i + 1, len)) == 0)
            return -1;
        i += 1 + k;
    }
    if (i < len && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < len && (s[i] == '+' || s[i] == '-'))
            i++;
        if ((k = digits(s, i, len)) == 0)
            return -1;
        i += k;
    }
    if (i != len)
        return -1;
    memcpy(buf, s, len);
    buf[len] = '\0';
    v = strtod(buf, &end);
    if (end != buf + len || !isfinite(v))
        return -1;      /* 1e999: out of range (an underflow to 0 or a subnormal is a finite value) */
    *out = v;
    return 0;
}

int delta_metrics_add(delta_metrics *m, const char *name, size_t len, double v)
{
    char key[DELTA_METRIC_NAME_MAX + 1];
    size_t at = 0;

    if (m->nnamed >= DELTA_METRICS_MAX || len == 0 || len > DELTA_METRIC_NAME_MAX || memchr(name, '\0', len) != NULL)
        return -1;
    memcpy(key, name, len);
    key[len] = '\0';
    while (at < m->nnamed && strcmp(m->name[at], key) < 0)
        at++;
    if (at < m->nnamed && strcmp(m->name[at], key) == 0)
        return -1;
    memmove(m->name[at + 1], m->name[at], (m->nnamed - at) * sizeof(m->name[0]));
    memmove(&m->value[at + 1], &m->value[at], (m->nnamed - at) * sizeof(m->value[0]));
    memcpy(m->name[at], key, len + 1);
    m->value[at] = v;
    m->nnamed++;
    return 0;
}

/* The worker-reported keys of a delta's metadata (delta.h, delta_metrics); other keys pass untouched. */
static int check_metrics(const st_meta *meta, size_t nmeta, delta_metrics *m, dl_error *err)
{
    static const struct {
        const char *key;
        unsigned bit;
    } known[] = {
        {"loss", DELTA_M_LOSS}, {"num_tokens", DELTA_M_NUM_TOKENS}, {"inner_steps", DELTA_M_INNER_STEPS},
        {"tokens_per_second", DELTA_M_TOKENS_PER_SECOND}, {"weight", DELTA_M_WEIGHT},
    };
    static const char prefix[] = "metric.";
    const size_t plen = sizeof(prefix) - 1;

    memset(m, 0, sizeof(*m));
    for (size_t i = 0; i < nmeta; i++) {
        const char *key = meta[i].key, *v = meta[i].value;
        size_t kl = meta[i].key_len, vl = meta[i].value_len, k;
        uint64_t n;
        double x;

        for (k = 0; k < sizeof(known) / sizeof(known[0]); k++)
            if (kl == strlen(known[k].key) && memcmp(key, known[k].key, kl) == 0)
                break;
        if (k < sizeof(known) / sizeof(known[0])) {
            unsigned bit = known[k].bit;
            if (bit == DELTA_M_NUM_TOKENS || bit == DELTA_M_INNER_STEPS) {
                if (delta_parse_int(v, vl, &n) != 0)
                    return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                                   "delta metadata %s \"%.32s\" is not a canonical non-negative integer", known[k].key,
                                   v);
                if (bit == DELTA_M_NUM_TOKENS)
                    m->num_tokens = n;
                else
                    m->inner_steps = n;
            } else {
                if (delta_parse_metric_value(v, vl, &x) != 0)
                    return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                                   "delta metadata %s \"%.32s\" is not a finite decimal number (-?digits[.digits]"
                                   "[e[+-]digits], at most %d characters)", known[k].key, v, DELTA_METRIC_VALUE_MAX);
                if (bit == DELTA_M_WEIGHT && !(x > 0))
                    return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                                   "delta metadata weight \"%.32s\" is not above 0", v);
                if (bit == DELTA_M_TOKENS_PER_SECOND && x < 0)
                    return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                                   "delta metadata tokens_per_second \"%.32s\" is negative", v);
                x += 0.0;       /* -0 is 0 */
                if (bit == DELTA_M_LOSS)
                    m->loss = x;
                else if (bit == DELTA_M_WEIGHT)
                    m->weight = x;
                else
                    m->tokens_per_second = x;
            }
            m->have |= bit;
            continue;
        }
        if (kl < plen || memcmp(key, prefix, plen) != 0)
            continue;
        if (!delta_valid_metric_name(key + plen, kl - plen))
            return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                           "delta metadata key \"%.48s\" is not a metric name (metric.<name>, name [A-Za-z0-9_]{1,%d})",
                           key, DELTA_METRIC_NAME_MAX);
        if (delta_parse_metric_value(v, vl, &x) != 0)
            return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                           "delta metadata %.48s \"%.32s\" is not a finite decimal number (-?digits[.digits]"
                           "[e[+-]digits], at most %d characters)", key, v, DELTA_METRIC_VALUE_MAX);
        if (m->nnamed == DELTA_METRICS_MAX)
            return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                           "delta metadata %.48s: more than %d metric.<name> keys", key, DELTA_METRICS_MAX);
        if (delta_metrics_add(m, key + plen, kl - plen, x + 0.0) != 0)
            return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "delta metadata %.48s is given twice", key);
    }
    return 0;
}

static int check_metadata(const st_meta *meta, size_t nmeta, delta_info *info, dl_error *err)
{
    static const char *const required[] = {"algorithm", "base_outer_step", "local_step", "node_id"};
    const char *v;
    size_t len;

    for (size_t i = 0; i < sizeof(required) / sizeof(required[0]); i++) {
        if (meta_find(meta, nmeta, required[i], NULL) == NULL)
            return dl_fail(err, DL_E_METADATA_MISSING, NULL, 0, "delta metadata lacks \"%s\"", required[i]);
    }
    v = meta_find(meta, nmeta, "algorithm", &len);
    if (len != strlen(DELTA_ALGORITHM) || memcmp(v, DELTA_ALGORITHM, len) != 0)
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "delta metadata algorithm is \"%.64s\", expected \"%s\"",
                       v, DELTA_ALGORITHM);
    v = meta_find(meta, nmeta, "base_outer_step", &len);
    if (delta_parse_int(v, len, &info->base_outer_step) != 0)
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                       "delta metadata base_outer_step \"%.32s\" is not a canonical non-negative integer", v);
    v = meta_find(meta, nmeta, "local_step", &len);
    if (delta_parse_int(v, len, &info->local_step) != 0)
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                       "delta metadata local_step \"%.32s\" is not a canonical non-negative integer", v);
    v = meta_find(meta, nmeta, "node_id", &len);
    if (!delta_valid_node_id(v, len))
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                       "delta metadata node_id \"%.64s\" is not a valid node id ([A-Za-z0-9._-]{1,64})", v);
    memcpy(info->node_id, v, len);
    info->node_id[len] = '\0';
    int rc = check_metrics(meta, nmeta, &info->metrics, err);
    return rc != 0 ? rc : cz_spec_from_meta(meta, nmeta, &info->cz, err);
}

int delta_parse_any_path(const char *path, delta_path *out, dl_error *err)
{
    static const char prefix[] = "nodes/", fprefix[] = "delta_";
    const char *id, *slash, *file;
    char base[ST_INDEX_BASE_MAX + 1];
    size_t id_len;
    uint32_t i = 0, n = 0;
    st_name_kind kind;

    memset(out, 0, sizeof(*out));
    if (strncmp(path, prefix, sizeof(prefix) - 1) != 0 || (slash = strchr(path + sizeof(prefix) - 1, '/')) == NULL)
        goto bad;
    id = path + sizeof(prefix) - 1;
    id_len = (size_t)(slash - id);
    if (!delta_valid_node_id(id, id_len))
        return dl_fail(err, DL_E_INVALID_PATH, NULL, 0,
                       "invalid node id in delta path (allowed: [A-Za-z0-9._-]{1,64}, not . or ..)");
    file = slash + 1;
    if (strchr(file, '/') != NULL)
        goto bad;
    kind = st_index_classify(file, strlen(file), base, &i, &n);
    if (kind == ST_NAME_OTHER || strncmp(base, fprefix, sizeof(fprefix) - 1) != 0)
        goto bad;
    if (delta_parse_int(base + sizeof(fprefix) - 1, strlen(base) - (sizeof(fprefix) - 1), &out->local_step) != 0)
        return dl_fail(err, DL_E_INVALID_PATH, NULL, 0,
                       "invalid local step in delta path (a decimal integer without sign or leading zeros)");
    out->kind = kind == ST_NAME_SINGLE ? DELTA_PATH_SINGLE : kind == ST_NAME_INDEX ? DELTA_PATH_INDEX : DELTA_PATH_SHARD;
    out->shard = i;
    out->nshards = n;
    memcpy(out->node_id, id, id_len);
    out->node_id[id_len] = '\0';
    return 0;
bad:
    return dl_fail(err, DL_E_INVALID_PATH, NULL, 0,
                   "not a delta path: expected nodes/<node_id>/delta_<local_step>.safetensors (or its "
                   ".safetensors.index.json and -<i>-of-<N>.safetensors shards)");
}

int delta_check_meta(const st_meta *meta, size_t nmeta, const char *path, delta_info *info, dl_error *err)
{
    delta_info local;
    delta_path p;
    int rc;

    if (info == NULL)
        info = &local;
    if ((rc = check_metadata(meta, nmeta, info, err)) != 0 || path == NULL)
        return rc;
    if ((rc = delta_parse_any_path(path, &p, err)) != 0)
        return rc;
    if (p.kind == DELTA_PATH_SHARD)
        return dl_fail(err, DL_E_INVALID_PATH, NULL, 0,
                       "a shard's path does not name a delta: its metadata is in the set's index");
    if (strcmp(p.node_id, info->node_id) != 0)
        return dl_fail(err, DL_E_PATH_MISMATCH, NULL, 0,
                       "delta metadata node_id \"%s\" does not match the path's node id \"%s\"",
                       info->node_id, p.node_id);
    if (p.local_step != info->local_step)
        return dl_fail(err, DL_E_PATH_MISMATCH, NULL, 0,
                       "delta metadata local_step %llu does not match the path's step %llu",
                       (unsigned long long)info->local_step, (unsigned long long)p.local_step);
    return 0;
}

int delta_header_by_name(const st_header *h, const st_tensor ***out, dl_error *err)
{
    const st_tensor **v = malloc((h->ntensors ? h->ntensors : 1) * sizeof(*v));

    if (v == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t i = 0; i < h->ntensors; i++)
        v[i] = &h->tensors[h->by_name[i]];
    *out = v;
    return 0;
}

static int name_cmp(const st_tensor *a, const st_tensor *b)
{
    size_t m = a->name_len < b->name_len ? a->name_len : b->name_len;
    int c = memcmp(a->name, b->name, m);
    return c != 0 ? c : (a->name_len > b->name_len) - (a->name_len < b->name_len);
}

static const st_tensor *by_name_find(const st_tensor *const *v, size_t n, const st_tensor *key)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = name_cmp(v[mid], key);
        if (c == 0)
            return v[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static int compressed(const cz_spec *cz)
{
    return cz != NULL && cz->enc != CZ_NONE;
}

/* One delta tensor against its global tensor g: shape and dtype (codes of the encoding too, when the
 * delta has one: a complex key stays plain). */
static int check_one(const st_tensor *g, const st_tensor *d, const cz_spec *cz, dl_error *err)
{
    if (!same_shape(g, d))
        return shape_mismatch(err, g, d, "delta tensor");
    st_dtype expect = delta_dtype_for(g->dtype);
    int ok = expect == ST_C64 ? d->dtype == ST_C64 : (d->dtype == ST_F32 || d->dtype == ST_F16 || d->dtype == ST_BF16);
    if (!ok && compressed(cz) && expect != ST_C64 && d->dtype == cz_code_dtype(cz->enc))
        ok = 1;
    if (!ok)
        return dl_fail(err, DL_E_DTYPE_MISMATCH, d->name, d->name_len,
                       "delta tensor has dtype %s, expected %s%s%s for a %s weight", st_dtype_name(d->dtype),
                       expect == ST_C64 ? "C64" : "F32 (or F16/BF16)",
                       compressed(cz) && expect != ST_C64 ? " or the codes of " : "",
                       compressed(cz) && expect != ST_C64 ? cz_encoding_name(cz->enc) : "", st_dtype_name(g->dtype));
    return 0;
}

/* The tensor named by the first len bytes of name in v (n tensors in name order), or NULL. */
static const st_tensor *find_prefix(const st_tensor *const *v, size_t n, const char *name, size_t len)
{
    st_tensor key = {.name = (char *)name, .name_len = len};
    return by_name_find(v, n, &key);
}

/* The scales of key t in v (n tensors in name order), or NULL (and *oom when the name could not be
 * built). */
static const st_tensor *find_scales(const st_tensor *const *v, size_t n, const st_tensor *t, int *oom)
{
    char *name = cz_scales_name(t->name, t->name_len);
    const st_tensor *sc = name != NULL ? find_prefix(v, n, name, t->name_len + CZ_SCALES_SUFFIX_LEN) : NULL;

    *oom = name == NULL;
    free(name);
    return sc;
}

/* The scales rules of a compressed delta: each key with codes has its scales (dtype, one per block),
 * every scales tensor belongs to a key with codes, and no model key looks like a scales tensor. */
static int check_scales(const st_tensor *const *delta, size_t nd, const cz_spec *cz, dl_error *err)
{
    const st_dtype code = cz_code_dtype(cz->enc), scale = cz_scale_dtype(cz->enc);
    int oom = 0;

    for (size_t i = 0; i < nd; i++) {
        const st_tensor *d = delta[i];
        if (cz_is_scales_name(d->name, d->name_len)) {
            const st_tensor *c = find_prefix(delta, nd, d->name, d->name_len - CZ_SCALES_SUFFIX_LEN);
            if (c == NULL || c->dtype != code)
                return dl_fail(err, DL_E_KEY_MISMATCH, d->name, d->name_len, "scales for a key that holds no %s codes",
                               cz_encoding_name(cz->enc));
            continue;
        }
        if (d->dtype != code)
            continue;
        const st_tensor *sc = find_scales(delta, nd, d, &oom);
        if (sc == NULL)
            return oom ? dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory")
                       : dl_fail(err, DL_E_KEY_MISMATCH, d->name, d->name_len,
                                 "delta tensor holds %s codes but its scales (the key + \"%s\") are missing",
                                 cz_encoding_name(cz->enc), CZ_SCALES_SUFFIX);
        uint64_t want = cz_nscales(d->nelem, cz->block);
        if (sc->dtype != scale)
            return dl_fail(err, DL_E_DTYPE_MISMATCH, sc->name, sc->name_len, "scales have dtype %s, expected %s for %s",
                           st_dtype_name(sc->dtype), st_dtype_name(scale), cz_encoding_name(cz->enc));
        if (sc->ndim != 1 || sc->shape[0] != want)
            return dl_fail(err, DL_E_SHAPE_MISMATCH, sc->name, sc->name_len,
                           "scales must have shape [%llu] (one per block of %u of the key's %llu values)",
                           (unsigned long long)want, cz->block, (unsigned long long)d->nelem);
    }
    return 0;
}

/* Whether every key of a (its scales and, in the global, its non-floating keys included) starts with the
 * len bytes of p. */
static int all_start_with(const st_tensor *const *a, size_t n, const char *p, size_t len)
{
    for (size_t i = 0; i < n; i++)
        if (a[i]->name_len <= len || memcmp(a[i]->name, p, len) != 0)
            return 0;
    return n > 0;
}

/* A key mismatch where one side's keys all carry a prefix ending in '.' that the other's lack: the state_dict
 * of a wrapped model (DDP and DataParallel add "module.", torch.compile "_orig_mod.").  Writes the advice into
 * out, or "" when the keys differ otherwise. */
static void prefix_hint(const st_tensor *const *delta, size_t nd, const st_tensor *const *global, size_t ng,
                        char *out, size_t size)
{
    out[0] = '\0';
    if (nd == 0 || ng == 0)
        return;
    for (int side = 0; side < 2; side++) {
        /* side 0: the delta's keys are longer (P + the global's); side 1: the global's are */
        const st_tensor *const *longer = side == 0 ? delta : global, *const *shorter = side == 0 ? global : delta;
        size_t nl = side == 0 ? nd : ng, ns = side == 0 ? ng : nd;
        const st_tensor *l = longer[0];
        for (size_t j = 0; j < ns; j++) {
            const st_tensor *t = shorter[j];
            if (l->name_len <= t->name_len + 1)
                continue;
            size_t plen = l->name_len - t->name_len;
            if (l->name[plen - 1] != '.' || memcmp(l->name + plen, t->name, t->name_len) != 0 ||
                plen > 64 || !all_start_with(longer, nl, l->name, plen) || all_start_with(shorter, ns, l->name, plen))
                continue;
            snprintf(out, size, side == 0 ? "; every key of the delta starts with \"%.*s\", which the global model's "
                     "keys do not: a wrapped model's state_dict (DDP adds \"module.\", torch.compile \"_orig_mod.\"): "
                     "take the unwrapped model's (model.module, model._orig_mod)"
                     : "; every key of the global model starts with \"%.*s\", which the delta's keys do not: the "
                     "global was saved from a wrapped model: compute the delta from a model with the same keys",
                     (int)plen, l->name);
            return;
        }
    }
}

int delta_check_tensors(const st_tensor *const *delta, size_t nd, const st_tensor *const *global, size_t ng,
                        const cz_spec *cz, dl_error *err)
{
    char hint[400];

    size_t i = 0, k = 0;

    for (size_t j = 0; compressed(cz) && j < ng; j++)
        if (cz_is_scales_name(global[j]->name, global[j]->name_len))
            return dl_fail(err, DL_E_KEY_MISMATCH, global[j]->name, global[j]->name_len,
                           "the model's key ends in %s, which compressed deltas reserve for scales: this model "
                           "takes plain deltas only", CZ_SCALES_SUFFIX);
    /* Both lists are in name order: walk them together to name the first missing or extra key;
     * the global's non-floating tensors are stepped over, and a compressed delta's scales (checked
     * after the walk). */
    for (;;) {
        while (k < ng && !st_dtype_is_floating(global[k]->dtype))
            k++;
        while (i < nd && compressed(cz) && cz_is_scales_name(delta[i]->name, delta[i]->name_len))
            i++;
        if (i == nd && k == ng)
            return compressed(cz) ? check_scales(delta, nd, cz, err) : 0;
        const st_tensor *d = i < nd ? delta[i] : NULL, *g = k < ng ? global[k] : NULL;
        int c = d == NULL ? 1 : g == NULL ? -1 : name_cmp(d, g);
        if (c != 0)
            prefix_hint(delta, nd, global, ng, hint, sizeof(hint));
        if (c < 0)
            return dl_fail(err, DL_E_KEY_MISMATCH, d->name, d->name_len, "%s%s",
                           by_name_find(global, ng, d) != NULL ? "delta carries a non-floating key of the global model"
                                                               : "delta carries a key the global model does not have",
                           hint);
        if (c > 0)
            return dl_fail(err, DL_E_KEY_MISMATCH, g->name, g->name_len, "delta lacks a floating key of the global "
                           "model%s", hint);
        int rc = check_one(g, d, cz, err);
        if (rc != 0)
            return rc;
        i++;
        k++;
    }
}

int delta_check_header(const st_header *delta, const st_header *global, const char *path,
                       delta_info *info, dl_error *err)
{
    const st_tensor **d = NULL, **g = NULL;
    delta_info local;
    int rc;

    if (info == NULL)
        info = &local;
    if ((rc = delta_check_meta(delta->meta, delta->nmeta, path, info, err)) != 0)
        return rc;
    if ((rc = delta_header_by_name(delta, &d, err)) == 0 && (rc = delta_header_by_name(global, &g, err)) == 0)
        rc = delta_check_tensors(d, delta->ntensors, g, global->ntensors, &info->cz, err);
    free(d);
    free(g);
    return rc;
}

int delta_may_be_scales(const st_header *global, const st_tensor *t)
{
    return cz_is_scales_name(t->name, t->name_len) && st_header_find(global, t->name, t->name_len) == NULL;
}

/* A shard's scales tensor d (named K + suffix, K not NULL when it is a model's floating key): against
 * the encoding when it is known, else the dtypes of every encoding's scales; its codes in this shard. */
static int check_shard_scales(const st_header *shard, const st_tensor *d, const st_tensor *k, const cz_spec *cz,
                              dl_error *err)
{
    const st_tensor *codes = k != NULL ? st_header_find(shard, k->name, k->name_len) : NULL;
    int dtype_ok = cz != NULL ? d->dtype == cz_scale_dtype(cz->enc) : (d->dtype == ST_F32 || d->dtype == ST_F8_E8M0);

    if (k == NULL || k->dtype == ST_C64)
        return dl_fail(err, DL_E_KEY_MISMATCH, d->name, d->name_len, "scales for a key the model has no floating weight for");
    if (codes == NULL || delta_plain_dtype(codes->dtype))
        return dl_fail(err, DL_E_KEY_MISMATCH, d->name, d->name_len,
                       "scales without their key's codes in this shard: a key's codes and scales must be in one shard");
    if (!dtype_ok || d->ndim != 1)
        return dl_fail(err, DL_E_DTYPE_MISMATCH, d->name, d->name_len, "scales have dtype %s and %zu dimensions",
                       st_dtype_name(d->dtype), d->ndim);
    if (cz != NULL && d->shape[0] != cz_nscales(codes->nelem, cz->block))
        return dl_fail(err, DL_E_SHAPE_MISMATCH, d->name, d->name_len,
                       "scales must have shape [%llu] (one per block of %u of the key's %llu values)",
                       (unsigned long long)cz_nscales(codes->nelem, cz->block), cz->block,
                       (unsigned long long)codes->nelem);
    return 0;
}

int delta_check_shard_header(const st_header *shard, const st_tensor *const *global, size_t nglobal,
                             const cz_spec *cz, dl_error *err)
{
    int compressed_ok = cz == NULL || cz->enc != CZ_NONE;

    for (size_t i = 0; i < shard->ntensors; i++) {
        const st_tensor *d = &shard->tensors[shard->by_name[i]];
        const st_tensor *g = by_name_find(global, nglobal, d);
        int rc;
        if (g == NULL && compressed_ok && cz_is_scales_name(d->name, d->name_len)) {
            const st_tensor *k = find_prefix(global, nglobal, d->name, d->name_len - CZ_SCALES_SUFFIX_LEN);
            if ((rc = check_shard_scales(shard, d, k != NULL && st_dtype_is_floating(k->dtype) ? k : NULL, cz, err)) != 0)
                return rc;
            continue;
        }
        if (g == NULL || !st_dtype_is_floating(g->dtype))
            return dl_fail(err, DL_E_KEY_MISMATCH, d->name, d->name_len,
                           g != NULL ? "delta carries a non-floating key of the global model"
                                     : "delta carries a key the global model does not have");
        /* codes: of the set's encoding, or (not known yet) of the encoding their dtype belongs to */
        const cz_spec guess = {d->dtype == ST_F8_E4M3 ? CZ_MXFP8 : d->dtype == ST_F4 ? CZ_MXFP4 : CZ_INT8_BLOCK, 0};
        if ((rc = check_one(g, d, cz != NULL ? cz : &guess, err)) != 0)
            return rc;
        if (!delta_plain_dtype(d->dtype)) {
            const st_tensor *sc = delta_scales_of(shard, d);
            if (sc == NULL)
                return dl_fail(err, DL_E_KEY_MISMATCH, d->name, d->name_len,
                               "codes without their scales in this shard: a key's codes and scales must be in one shard");
        }
    }
    return 0;
}

int delta_check_set_header(const st_set *delta, const st_tensor *const *global, size_t nglobal, const char *path,
                           delta_info *info, dl_error *err)
{
    const st_meta *meta;
    size_t nmeta;
    int rc;

    delta_info local;

    if (info == NULL)
        info = &local;
    st_set_metadata(delta, &meta, &nmeta);
    if ((rc = delta_check_meta(meta, nmeta, path, info, err)) != 0)
        return rc;
    if ((rc = delta_check_tensors(delta->by_name, delta->ntensors, global, nglobal, &info->cz, err)) != 0)
        return rc;
    /* each compressed key's codes and scales in one shard: each shard decodes on its own */
    for (size_t i = 0; info->cz.enc != CZ_NONE && i < delta->ntensors; i++) {
        const st_tensor *t = delta->by_name[i];
        uint32_t fc = 0, fs = 0;
        if (!delta_is_scales(&info->cz, t))
            continue;
        (void)st_set_find(delta, t->name, t->name_len, &fs);
        if (st_set_find(delta, t->name, t->name_len - CZ_SCALES_SUFFIX_LEN, &fc) != NULL && fc != fs)
            return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len,
                           "the scales are in shard %u, their codes in shard %u: a key's codes and scales must be in "
                           "one shard", fs + 1, fc + 1);
    }
    return 0;
}

/* Whether any of n lanes is at or above bound once its sign is cleared (an all-ones exponent: NaN, Inf,
 * is above every finite bound): a branch-free OR the compiler vectorises, in an AVX-512 or AVX2 copy
 * where the CPU has it (a 1 GiB mapped delta checked at 8.6-9.1 GB/s on one thread here, against
 * 7.2-7.4 GB/s in SSE2: the value check of every delta an intake takes in). */
KERNEL_CLONES static int any_at_or_above32(const uint32_t *u, size_t n, uint32_t bound)
{
    uint32_t acc = 0;
    for (size_t i = 0; i < n; i++)
        acc |= (uint32_t)((u[i] & 0x7fffffffu) >= bound);
    return acc != 0;
}

KERNEL_CLONES static int any_at_or_above16(const uint16_t *h, size_t n, uint16_t bound)
{
    uint32_t acc = 0;
    for (size_t i = 0; i < n; i++)
        acc |= (uint32_t)((h[i] & 0x7fffu) >= bound);
    return acc != 0;
}

/* The first element of n of dt whose magnitude's bits reach the bound (F32 and C64 lanes: bound32;
 * F16, BF16: their own), or -1. */
static int64_t find_at_or_above(st_dtype dt, const void *data, size_t nelem, uint32_t bound32, uint16_t bound_f16,
                                uint16_t bound_bf16)
{
    enum { BLOCK = 4096 };
    if (dt == ST_F32 || dt == ST_C64) {
        const uint32_t *u = data;
        size_t lanes = nelem * cv_lanes(dt);
        for (size_t b = 0; b < lanes; b += BLOCK) {
            size_t n = lanes - b < BLOCK ? lanes - b : BLOCK;
            if (!any_at_or_above32(u + b, n, bound32))
                continue;
            for (size_t i = b; i < b + n; i++)      /* rare: find the element to name it */
                if ((u[i] & 0x7fffffffu) >= bound32)
                    return (int64_t)(i / cv_lanes(dt));
        }
    } else if (dt == ST_F16 || dt == ST_BF16) {
        const uint16_t *h = data;
        uint16_t bound = dt == ST_F16 ? bound_f16 : bound_bf16;
        for (size_t b = 0; b < nelem; b += BLOCK) {
            size_t n = nelem - b < BLOCK ? nelem - b : BLOCK;
            if (!any_at_or_above16(h + b, n, bound))
                continue;
            for (size_t i = b; i < b + n; i++)
                if ((h[i] & 0x7fffu) >= bound)
                    return (int64_t)i;
        }
    }
    return -1;
}

int64_t delta_find_non_finite(st_dtype dt, const void *data, size_t nelem)
{
    /* the all-ones exponent and anything above it in magnitude order: Inf, then the NaNs */
    return find_at_or_above(dt, data, nelem, 0x7f800000u, 0x7c00u, 0x7f80u);
}

int64_t delta_find_bad_value(st_dtype dt, const void *data, size_t nelem)
{
    /* 2^64 and up (and NaN, Inf): F32 and BF16 share the exponent field; every finite F16 is below it */
    return find_at_or_above(dt, data, nelem, DELTA_VALUE_BOUND_F32_BITS, 0x7c00u, 0x5f80u);
}

const st_tensor *delta_scales_of(const st_header *h, const st_tensor *t)
{
    char *name = cz_scales_name(t->name, t->name_len);
    const st_tensor *sc = name != NULL ? st_header_find(h, name, t->name_len + CZ_SCALES_SUFFIX_LEN) : NULL;

    free(name);
    return sc;
}

void delta_scales_range(const cz_spec *cz, uint64_t first, uint64_t n, uint64_t *off, uint64_t *len)
{
    const uint64_t b0 = first / cz->block, b1 = (first + n + cz->block - 1) / cz->block;
    const uint64_t size = st_dtype_bits(cz_scale_dtype(cz->enc)) / 8;

    *off = b0 * size;
    *len = (b1 - b0) * size;
}

uint64_t delta_ck_compressed(const ck_key *key, uint32_t mt, const cz_spec *cz, uint64_t first, const void *codes,
                             const void *scales, uint64_t n)
{
    const st_dtype cd = cz_code_dtype(cz->enc), sd = cz_scale_dtype(cz->enc);
    const uint64_t per = CK_BLOCK_ELEMS / cz->block;        /* scales per checksum block of values */

    return ck_blocks_of(key, mt, cd, first, codes, n, st_dtype_bits(cd), CK_BLOCK_ELEMS) +
           ck_blocks_of(key, CK_SCALES_OF(mt), sd, first / cz->block, scales, cz_nscales(n, cz->block),
                        st_dtype_bits(sd), per);
}

int delta_decode_checked(const cz_spec *cz, const st_tensor *t, const void *codes, const void *scales,
                         uint64_t first, float *out, size_t n, delta_norm *norm, delta_norm_block *nb, dl_error *err)
{
    int64_t bad = cz_decode(cz, codes, scales, first, out, n);

    if (bad >= 0)
        return dl_fail(err, DL_E_NON_FINITE, t->name, t->name_len,
                       "delta tensor's %s codes decode to " DELTA_BAD_VALUE_TEXT " at element %llu: a NaN code or "
                       "scale, a negative scale, or a scale that overflows or passes the bound",
                       cz_encoding_name(cz->enc), (unsigned long long)(first + (uint64_t)bad));
    if (norm != NULL)
        delta_norm_feed(norm, nb, ST_F32, out, n);
    return 0;
}

/* Every value of every tensor of f is finite (NaN and Inf are refused with the element named); a
 * compressed key's values as they decode (its scales are read with its codes). */
static int scan_finite(const st_file *f, const cz_spec *cz, dl_error *err)
{
    unsigned char *buf = malloc((size_t)CHUNK_ELEMS * 8), *scales = malloc((size_t)CHUNK_ELEMS * 4 / CZ_BLOCK_MIN + 4);
    float *out = malloc((size_t)CHUNK_ELEMS * sizeof(float));
    int rc = 0;

    if (buf == NULL || scales == NULL || out == NULL)
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t i = 0; i < f->h->ntensors && rc == 0; i++) {
        const st_tensor *t = &f->h->tensors[i], *sc = NULL;
        if (delta_is_scales(cz, t))
            continue;                   /* read with their codes */
        if (!delta_plain_dtype(t->dtype)) {
            if (cz->enc == CZ_NONE || t->dtype != cz_code_dtype(cz->enc))
                continue;               /* delta_check_header refused it */
            if ((sc = delta_scales_of(f->h, t)) == NULL) {
                rc = dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len, "the codes' scales are missing");
                break;
            }
        }
        size_t esize = st_dtype_bits(t->dtype) / 8;
        for (uint64_t e = 0; e < t->nelem && rc == 0; e += CHUNK_ELEMS) {
            size_t n = (size_t)(t->nelem - e < CHUNK_ELEMS ? t->nelem - e : CHUNK_ELEMS);
            int64_t bad;
            if (sc != NULL) {
                uint64_t soff, slen;
                delta_scales_range(cz, e, n, &soff, &slen);
                if ((rc = st_read(f, t, cz_code_bytes(cz->enc, e), buf, (size_t)cz_code_bytes(cz->enc, n), err)) != 0 ||
                    (rc = st_read(f, sc, soff, scales, (size_t)slen, err)) != 0)
                    break;
                rc = delta_decode_checked(cz, t, buf, scales, e, out, n, NULL, NULL, err);
                continue;
            }
            if ((rc = st_read(f, t, e * esize, buf, n * esize, err)) != 0)
                break;
            if ((bad = delta_find_bad_value(t->dtype, buf, n)) >= 0)
                rc = dl_fail(err, DL_E_NON_FINITE, t->name, t->name_len,
                             "delta tensor holds " DELTA_BAD_VALUE_TEXT " at element %llu",
                             (unsigned long long)(e + (uint64_t)bad));
        }
    }
    free(buf);
    free(scales);
    free(out);
    return rc;
}

int delta_validate(const st_file *delta, const st_header *global, const char *path, delta_info *info,
                   dl_error *err)
{
    delta_info local;
    int rc;

    if (info == NULL)
        info = &local;
    if ((rc = delta_check_header(delta->h, global, path, info, err)) != 0)
        return rc;
    return scan_finite(delta, &info->cz, err);
}

int delta_validate_set(const st_set *delta, const st_tensor *const *global, size_t nglobal, const char *path,
                       delta_info *info, dl_error *err)
{
    delta_info local;
    int rc;

    if (info == NULL)
        info = &local;
    if ((rc = delta_check_set_header(delta, global, nglobal, path, info, err)) != 0)
        return rc;
    for (size_t f = 0; f < delta->nfiles && rc == 0; f++)
        rc = scan_finite(delta->files[f], &info->cz, err);
    return rc;
}

/* Reads n elements of t starting at element e and decodes them into out (F32 lanes). */
int delta_read_f32(const st_set *s, uint32_t file, const st_tensor *t, uint64_t e, size_t n, void *raw,
                    float *out, dl_error *err)
{
    size_t esize = st_dtype_bits(t->dtype) / 8;
    int rc;

    if ((rc = st_set_read(s, file, t, e * esize, raw, n * esize, err)) != 0)
        return rc;
    if (cv_decode(t->dtype, raw, out, n) != 0)
        return dl_fail(err, DL_E_UNSUPPORTED_DTYPE, t->name, t->name_len,
                       "arithmetic on %s tensors is not supported", st_dtype_name(t->dtype));
    return 0;
}

typedef struct chunk_bufs {
    unsigned char *raw;
    float *a, *b;
} chunk_bufs;

static int bufs_alloc(chunk_bufs *c, dl_error *err)
{
    c->raw = malloc((size_t)CHUNK_ELEMS * 8);
    c->a = malloc((size_t)CHUNK_ELEMS * 2 * sizeof(float));
    c->b = malloc((size_t)CHUNK_ELEMS * 2 * sizeof(float));
    if (c->raw == NULL || c->a == NULL || c->b == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    return 0;
}

static void bufs_free(chunk_bufs *c)
{
    free(c->raw);
    free(c->a);
    free(c->b);
}

int delta_check_pair(const st_set *fb, const st_set *fc, dl_error *err)
{
    /* exact key-set and shape equality over the whole state */
    if (fb->ntensors != fc->ntensors)
        return dl_fail(err, DL_E_KEY_MISMATCH, NULL, 0, "baseline has %zu tensors, current has %zu", fb->ntensors,
                       fc->ntensors);
    for (size_t i = 0; i < fb->ntensors; i++) {
        const st_tensor *b = fb->by_name[i];
        const st_tensor *c = st_set_find(fc, b->name, b->name_len, NULL);
        if (c == NULL)
            return dl_fail(err, DL_E_KEY_MISMATCH, b->name, b->name_len, "current model lacks this key");
        if (!same_shape(b, c))
            return shape_mismatch(err, b, c, "current tensor");
        if (st_dtype_is_floating(b->dtype) != st_dtype_is_floating(c->dtype) ||
            (b->dtype == ST_C64) != (c->dtype == ST_C64))
            return dl_fail(err, DL_E_DTYPE_MISMATCH, b->name, b->name_len, "baseline is %s, current is %s",
                           st_dtype_name(b->dtype), st_dtype_name(c->dtype));
    }
    return 0;
}

int delta_compute_set(const char *baseline, const char *current, const char *out, const char *node_id,
                      uint64_t base_outer_step, uint64_t local_step, uint64_t shard_size, dl_error *err)
{
    st_set *fb = NULL, *fc = NULL;
    const st_tensor **keys = NULL;
    uint32_t *bfile = NULL;
    st_spec *specs = NULL;
    st_set_writer *w = NULL;
    chunk_bufs cb = {0};
    size_t nkeys = 0;
    char bstep[24], lstep[24];
    int rc;

    if (!delta_valid_node_id(node_id, strlen(node_id)))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "invalid node id \"%.64s\"", node_id);
    if (base_outer_step > DELTA_INT_MAX || local_step > DELTA_INT_MAX)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "step out of range");
    if ((rc = st_set_open(baseline, &fb, err)) != 0 || (rc = st_set_open(current, &fc, err)) != 0 ||
        (rc = delta_check_pair(fb, fc, err)) != 0)
        goto out;
    /* the floating keys in the baseline's save order (a set's index order; name order for a file),
     * so a sharded delta splits where huggingface_hub would split the same state dict */
    keys = malloc((fb->ntensors ? fb->ntensors : 1) * sizeof(*keys));
    bfile = malloc((fb->ntensors ? fb->ntensors : 1) * sizeof(*bfile));
    specs = calloc(fb->ntensors ? fb->ntensors : 1, sizeof(*specs));
    if (keys == NULL || bfile == NULL || specs == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < fb->ntensors; i++) {
        const st_tensor *t = fb->order[i];
        if (!st_dtype_is_floating(t->dtype))
            continue;
        keys[nkeys] = t;
        bfile[nkeys] = fb->order_file[i];
        specs[nkeys] = (st_spec){t->name, t->name_len, delta_dtype_for(t->dtype), t->ndim, t->shape};
        nkeys++;
    }
    snprintf(bstep, sizeof(bstep), "%llu", (unsigned long long)base_outer_step);
    snprintf(lstep, sizeof(lstep), "%llu", (unsigned long long)local_step);
    st_kv meta[] = {{"algorithm", DELTA_ALGORITHM}, {"base_outer_step", bstep}, {"local_step", lstep},
                    {"node_id", node_id}};
    if ((rc = bufs_alloc(&cb, err)) != 0 ||
        (rc = st_set_writer_open(out, specs, nkeys, meta, 4, shard_size, &w, err)) != 0)
        goto out;
    for (size_t i = 0; i < nkeys; i++) {
        const st_tensor *b = keys[i];
        uint32_t cfile;
        const st_tensor *c = st_set_find(fc, b->name, b->name_len, &cfile);
        size_t lanes = cv_lanes(b->dtype);
        for (uint64_t e = 0; e < b->nelem; e += CHUNK_ELEMS) {
            size_t n = (size_t)(b->nelem - e < CHUNK_ELEMS ? b->nelem - e : CHUNK_ELEMS);
            if ((rc = delta_read_f32(fb, bfile[i], b, e, n, cb.raw, cb.a, err)) != 0 ||
                (rc = delta_read_f32(fc, cfile, c, e, n, cb.raw, cb.b, err)) != 0)
                goto out;
            for (size_t j = 0; j < n * lanes; j++)
                cb.a[j] -= cb.b[j];
            if ((rc = st_set_writer_write(w, i, e * lanes * 4, cb.a, n * lanes * 4, err)) != 0)
                goto out;
        }
    }
    rc = st_set_writer_commit(w, err);
    w = NULL;
out:
    st_set_writer_abort(w);
    bufs_free(&cb);
    free(specs);
    free(keys);
    free(bfile);
    st_set_close(fb);
    st_set_close(fc);
    return rc;
}

int delta_compute(const char *baseline, const char *current, const char *out, const char *node_id,
                  uint64_t base_outer_step, uint64_t local_step, dl_error *err)
{
    return delta_compute_set(baseline, current, out, node_id, base_outer_step, local_step, 0, err);
}

static int is_delta_dtype(st_dtype dt)
{
    return dt == ST_F32 || dt == ST_F16 || dt == ST_BF16 || dt == ST_C64;
}

/* Every set has the reference's keys, shapes and delta dtypes (C64 exactly where the reference has it). */
static int check_same_keys(st_set *const *f, const char *const *paths, size_t n, dl_error *err)
{
    const st_set *ref = f[0];

    for (size_t i = 0; i < ref->ntensors; i++) {
        const st_tensor *t = ref->by_name[i];
        if (!is_delta_dtype(t->dtype))
            return dl_fail(err, DL_E_DTYPE_MISMATCH, t->name, t->name_len,
                           "%s: delta tensors must be F32, F16, BF16 or C64, not %s", paths[0], st_dtype_name(t->dtype));
    }
    for (size_t k = 1; k < n; k++) {
        if (f[k]->ntensors != ref->ntensors)
            return dl_fail(err, DL_E_KEY_MISMATCH, NULL, 0, "%s has %zu tensors, %s has %zu", paths[k], f[k]->ntensors,
                           paths[0], ref->ntensors);
        for (size_t i = 0; i < ref->ntensors; i++) {
            const st_tensor *r = ref->by_name[i];
            const st_tensor *t = st_set_find(f[k], r->name, r->name_len, NULL);
            if (t == NULL)
                return dl_fail(err, DL_E_KEY_MISMATCH, r->name, r->name_len, "%s lacks this key", paths[k]);
            if (!same_shape(r, t))
                return shape_mismatch(err, r, t, paths[k]);
            if ((r->dtype == ST_C64) != (t->dtype == ST_C64) || !is_delta_dtype(t->dtype))
                return dl_fail(err, DL_E_DTYPE_MISMATCH, t->name, t->name_len, "%s has dtype %s, %s has %s", paths[k],
                               st_dtype_name(t->dtype), paths[0], st_dtype_name(r->dtype));
        }
    }
    return 0;
}

int delta_average_set(const char *const *paths, size_t n, const char *out, uint64_t shard_size, dl_error *err)
{
    st_set **f = NULL;
    st_spec *specs = NULL;
    const st_set *ref;
    st_set_writer *w = NULL;
    chunk_bufs cb = {0};
    int rc = 0;

    if (n == 0)
        return dl_fail(err, DL_E_EMPTY_INPUT, NULL, 0, "cannot average an empty list of deltas");
    f = calloc(n, sizeof(*f));
    if (f == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t i = 0; i < n; i++) {
        if ((rc = st_set_open(paths[i], &f[i], err)) != 0)
            goto out;
    }
    if ((rc = check_same_keys(f, paths, n, err)) != 0)
        goto out;
    ref = f[0];
    specs = calloc(ref->ntensors ? ref->ntensors : 1, sizeof(*specs));
    if (specs == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < ref->ntensors; i++) {
        const st_tensor *t = ref->order[i];
        specs[i] = (st_spec){t->name, t->name_len, delta_dtype_for(t->dtype), t->ndim, t->shape};
    }
    if ((rc = bufs_alloc(&cb, err)) != 0 ||
        (rc = st_set_writer_open(out, specs, ref->ntensors, NULL, 0, shard_size, &w, err)) != 0)
        goto out;
    const float count = (float)n;
    for (size_t i = 0; i < ref->ntensors; i++) {
        const st_tensor *r = ref->order[i];
        size_t lanes = cv_lanes(r->dtype);
        for (uint64_t e = 0; e < r->nelem; e += CHUNK_ELEMS) {
            size_t m = (size_t)(r->nelem - e < CHUNK_ELEMS ? r->nelem - e : CHUNK_ELEMS);
            if ((rc = delta_read_f32(ref, ref->order_file[i], r, e, m, cb.raw, cb.a, err)) != 0)
                goto out;
            for (size_t k = 1; k < n; k++) {
                uint32_t file;
                const st_tensor *t = st_set_find(f[k], r->name, r->name_len, &file);
                if ((rc = delta_read_f32(f[k], file, t, e, m, cb.raw, cb.b, err)) != 0)
                    goto out;
                for (size_t j = 0; j < m * lanes; j++)
                    cb.a[j] += cb.b[j];
            }
            for (size_t j = 0; j < m * lanes; j++)
                cb.a[j] /= count;
            if ((rc = st_set_writer_write(w, i, e * lanes * 4, cb.a, m * lanes * 4, err)) != 0)
                goto out;
        }
    }
    rc = st_set_writer_commit(w, err);
    w = NULL;
out:
    st_set_writer_abort(w);
    bufs_free(&cb);
    free(specs);
    for (size_t i = 0; i < n; i++)
        st_set_close(f[i]);
    free(f);
    return rc;
}

int delta_average(const char *const *paths, size_t n, const char *out, dl_error *err)
{
    return delta_average_set(paths, n, out, 0, err);
}

cJSON *delta_metadata_json(const st_header *h)
{
    cJSON *decoded = cJSON_CreateObject(), *raw = cJSON_CreateObject();
    int all_json = 1;

    if (decoded == NULL || raw == NULL)
        goto fail;
    for (size_t i = 0; i < h->nmeta; i++) {
        const st_meta *m = &h->meta[i];
        cJSON *s = cJSON_CreateString(m->value);
        if (s == NULL || !cJSON_AddItemToObject(raw, m->key, s))
            goto fail;
        if (all_json) {
            cJSON *v = cJSON_ParseWithOpts(m->value, NULL, 1);
            if (v == NULL)
                all_json = 0;
            else if (!cJSON_AddItemToObject(decoded, m->key, v)) {
                cJSON_Delete(v);
                goto fail;
            }
        }
    }
    if (all_json) {
        cJSON_Delete(raw);
        return decoded;
    }
    cJSON_Delete(decoded);
    return raw;
fail:
    cJSON_Delete(decoded);
    cJSON_Delete(raw);
    return NULL;
}
