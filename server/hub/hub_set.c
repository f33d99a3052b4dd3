#include "hub_set.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "delta.h"
#include "fsutil.h"

void hub_set_version_start(hub_set_version *v, const char *index_version)
{
    v->md = EVP_MD_CTX_new();
    v->bad = v->md == NULL || EVP_DigestInit_ex(v->md, EVP_sha256(), NULL) != 1 ||
             EVP_DigestUpdate(v->md, index_version, strlen(index_version) + 1) != 1;
}

/* Each field with its NUL: "ab"+"c" and "a"+"bc" hash apart. */
void hub_set_version_add(hub_set_version *v, const char *path, const char *version, uint64_t size)
{
    char num[24];

    if (v->bad)
        return;
    snprintf(num, sizeof(num), "%" PRIu64, size);
    v->bad = EVP_DigestUpdate(v->md, path, strlen(path) + 1) != 1 ||
             EVP_DigestUpdate(v->md, version, strlen(version) + 1) != 1 ||
             EVP_DigestUpdate(v->md, num, strlen(num) + 1) != 1;
}

int hub_set_version_end(hub_set_version *v, char *out, size_t size)
{
    static const char digits[] = "0123456789abcdef";
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned mdlen = 0;
    int bad = v->bad || EVP_DigestFinal_ex(v->md, md, &mdlen) != 1 || mdlen < 16 || size < 37;

    EVP_MD_CTX_free(v->md);
    v->md = NULL;
    if (bad)
        return -1;
    /* 128 bits of the hash: as unique as a set's files need, and short enough for the seen list */
    memcpy(out, "set-", 4);
    for (unsigned i = 0; i < 16; i++) {
        out[4 + 2 * i] = digits[md[i] >> 4];
        out[4 + 2 * i + 1] = digits[md[i] & 15];
    }
    out[36] = '\0';
    return 0;
}

int hub_set_base_verdict(const st_index *ix, uint64_t step, const hub_limits *lim, uint64_t *base)
{
    size_t vl;
    const char *v = st_index_meta(ix, "base_outer_step", &vl);

    *base = UINT64_MAX;
    if (v == NULL)
        return 0;
    if (delta_parse_int(v, vl, base) == 0 && hub_base_stale(lim, step, *base))
        return -1;
    return *base != UINT64_MAX && *base > step ? 1 : 0;
}

size_t hub_set_index_cap(const hub_limits *lim, int is_global)
{
    size_t cap = lim->delta_index_bytes;
    return is_global || cap == 0 || cap > ST_INDEX_MAX_BYTES ? ST_INDEX_MAX_BYTES : cap;
}

int hub_set_listed_shards(const st_index *ix, int (*listed)(const void *arg, const char *name, uint64_t *bytes),
                          const void *arg, char *name, size_t size, uint64_t *total)
{
    uint64_t bytes = 0;

    *total = 0;
    for (uint32_t i = 0; i < ix->nshards; i++) {
        if (st_index_shard_name(ix->base, i, ix->nshards, name, size) != 0 || !listed(arg, name, &bytes))
            return 1;
        if (__builtin_add_overflow(*total, bytes, total))
            *total = UINT64_MAX;
    }
    return 0;
}

static void parse_index_work(pool_job *pj)
{
    hub_index_job *j = pj->arg;

    if (j->verify != NULL && j->verify(j) != 0) {
        j->mismatch = 1;
        return;
    }
    j->rc = st_index_parse_capped(j->text, j->len, j->base, j->cap, &j->ix, &j->err);
}

static void parse_index_after(pool_job *pj)
{
    hub_index_job *j = pj->arg;

    j->cancelled = pj->cancelled;
    j->done(j);
}

hub_index_job *hub_index_job_new(char *text, size_t len, const char *rel, size_t cap, hub_index_parsed done,
                                 void *owner, void *arg)
{
    hub_index_job *j = text != NULL ? calloc(1, sizeof(*j)) : NULL;

    if (j == NULL) {
        free(text);
        return NULL;
    }
    j->text = text;
    j->len = len;
    j->cap = cap;
    j->done = done;
    j->owner = owner;
    j->arg = arg;
    j->rc = -1;
    hub_set_index_base(rel, j->base, sizeof(j->base));
    return j;
}

int hub_index_job_queue(job_owner *o, hub_index_job *j)
{
    return job_queue(o, parse_index_work, parse_index_after, j) == 0 ? 0 : -1;
}

void hub_index_job_free(hub_index_job *j)
{
    if (j == NULL)
        return;
    st_index_free(j->ix);
    free(j->text);
    free(j);
}

int hub_set_path_names(const char *path, const char *name)
{
    size_t pl = strlen(path), nl = strlen(name);

    return pl > nl && path[pl - nl - 1] == '/' && strcmp(path + pl - nl, name) == 0;
}

void hub_set_index_base(const char *rel, char *base, size_t size)
{
    const char *name = strrchr(rel, '/');
    size_t nl, sl = strlen(ST_INDEX_SUFFIX);

    name = name ? name + 1 : rel;
    nl = strlen(name);
    snprintf(base, size, "%.*s", nl > sl ? (int)(nl - sl) : 0, name);
}

hub_set *hub_set_new(hub_set **list, char *dir, const char *rel, const char *ver, int is_global, uint64_t step,
                     const char *index_text, size_t index_len, dl_error *err)
{
    hub_set *set = calloc(1, sizeof(*set));
    const char *name = strrchr(rel, '/');

    name = name ? name + 1 : rel;
    if (set == NULL || dir == NULL) {
        free(dir);
        goto oom;
    }
    set->dir = dir;
    if ((set->rel = strdup(rel)) == NULL || asprintf(&set->index_path, "%s/%s", set->dir, name) < 0) {
        set->index_path = NULL;
        goto oom;
    }
    snprintf(set->ver, sizeof(set->ver), "%s", ver);
    set->is_global = is_global;
    set->step = step;
    if (fsu_mkdirs(set->dir, err) != 0 || fsu_write_atomic(set->index_path, index_text, index_len, err) != 0)
        goto fail;
    set->next = *list;
    *list = set;
    return set;
oom:
    dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
fail:
    if (set != NULL) {
        free(set->rel);
        free(set->dir);
        free(set->index_path);
        free(set);
    }
    return NULL;
}

int hub_set_shard_done(hub_set *set, int ok, seen_state fail_state)
{
    if (!ok && !set->failed) {
        set->failed = 1;
        set->fail_state = fail_state;
    }
    if (set->pending > 0)
        set->pending--;
    return set->pending == 0;
}

void hub_set_hand_over(const hub_set *set, const hub_callbacks *cb, void *app)
{
    hub_delta d = {.rel = set->rel, .path = set->index_path, .root = NULL, .owned = 1};

    cb->delta_ready(app, &d);
}

void hub_set_remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;

    if (d == NULL)
        return;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            unlinkat(dirfd(d), e->d_name, 0);
    closedir(d);
    rmdir(dir);
}

void hub_set_drop(hub_set **list, hub_set *set, int keep_dir)
{
    if (!keep_dir)
        hub_set_remove_dir(set->dir);
    hub_set_free(list, set);
}

void hub_set_free(hub_set **list, hub_set *set)
{
    for (hub_set **p = list; *p; p = &(*p)->next)
        if (*p == set) {
            *p = set->next;
            break;
        }
    free(set->rel);
    free(set->dir);
    free(set->index_path);
    free(set);
}

int hub_set_other_layout(const char *name, int sharded, uint32_t nshards)
{
    char base[ST_INDEX_BASE_MAX + 1];
    uint32_t i = 0, n = 0;
    st_name_kind k = st_index_classify(name, strlen(name), base, &i, &n);

    if (strcmp(base, "latest") != 0)
        return 0;
    if (!sharded)
        return k == ST_NAME_INDEX || k == ST_NAME_SHARD;
    return k == ST_NAME_SINGLE || (k == ST_NAME_SHARD && n != nshards);
}

typedef struct pub_open {
    hub_pub_file *files;
    unsigned n;
} pub_open;

/* files[i] of n: opened, its size read. */
static int open_pub_file(pub_open *o, unsigned i, unsigned n, const char *path, const char *name)
{
    struct stat sb;

    if (o->files == NULL) {
        if ((o->files = calloc(n, sizeof(*o->files))) == NULL)
            return -1;
        o->n = n;
        for (unsigned k = 0; k < n; k++)
            o->files[k].fd = -1;
    }
    hub_pub_file *f = &o->files[i];
    snprintf(f->rel, sizeof(f->rel), "global/%s", name);
    if ((f->path = strdup(path)) == NULL || (f->fd = open(path, O_RDONLY | O_CLOEXEC)) < 0 || fstat(f->fd, &sb) != 0)
        return -1;
    f->size = (uint64_t)sb.st_size;
    return 0;
}

void hub_set_publish_close(hub_pub_file *files, unsigned n)
{
    for (unsigned i = 0; files != NULL && i < n; i++) {
        if (files[i].fd >= 0)
            close(files[i].fd);
        free(files[i].path);
    }
    free(files);
}

int hub_set_publish_open(const char *global_path, hub_pub_file **files, unsigned *n, dl_error *err)
{
    pub_open o = {0};
    st_index *ix = NULL;
    char path[4096], name[ST_INDEX_BASE_MAX + 48];
    int rc = -1;

    *files = NULL;
    *n = 0;
    if (!st_index_is_index_path(global_path)) {
        rc = open_pub_file(&o, 0, 1, global_path, "latest.safetensors") == 0
                 ? 0
                 : dl_fail(err, DL_E_IO, NULL, 0, "cannot read %.400s: %s", global_path, strerror(errno));
        goto out;
    }
    if ((rc = st_index_load(global_path, &ix, err)) != 0)
        goto out;
    rc = -1;
    if (strcmp(ix->base, "latest") != 0) {
        dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%.400s: a global's index is latest%s", global_path,
                ST_INDEX_SUFFIX);
        goto out;
    }
    const char *slash = strrchr(global_path, '/');
    int dlen = slash ? (int)(slash - global_path) : 1;
    const char *dir = slash ? global_path : ".";
    for (uint32_t i = 0; i <= ix->nshards; i++) {
        if (i == ix->nshards) {
            snprintf(name, sizeof(name), "latest%s", ST_INDEX_SUFFIX);
            snprintf(path, sizeof(path), "%s", global_path);
        } else if (st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name)) != 0 ||
                   snprintf(path, sizeof(path), "%.*s/%s", dlen, dir, name) >= (int)sizeof(path)) {
            dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%.400s: a shard's path is too long", global_path);
            goto out;
        }
        if (open_pub_file(&o, i, ix->nshards + 1, path, name) != 0) {
            dl_fail(err, DL_E_IO, NULL, 0, "cannot read %.400s: %s", path, strerror(errno));
            goto out;
        }
    }
    rc = 0;
out:
    st_index_free(ix);
    *files = o.files;
    *n = o.n;
    return rc;
}
