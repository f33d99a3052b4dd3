/* The file:// transport.  The tree under the root is written by other people, so it is read as
 * hostile: the root is the only path handed to open(); everything below it is reached with openat
 * one component at a time (fsutil's *_at helpers), never through a symbolic link, and nothing but
 * a directory or a regular file is ever opened.  A link, a FIFO, a device or a socket where a node
 * directory, a delta or a global file should be is reported (hub_candidate.refused or an error),
 * never read.  The root itself is the operator's choice and may be a link. */
#include "hub_file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "safetensors.h"
#include "st_index.h"
#include "stepcount.h"

/* Work and memory per scan stay bounded whatever a writer plants: node directories read (twice the
 * most nodes a round can have; a writer who makes more can hide the rest, and that is logged), delta
 * files looked at per node directory (sync: the newest by local step, as one delta per node counts;
 * async: the lowest from the node's resume point, as every delta is an update and the next scan goes
 * on), and refused entries reported.
 * Entries whose names are not valid cost one directory record each and nothing else. */
#define MAX_NODE_DIRS 8192
#define MAX_DELTAS_PER_NODE HUBFILE_DELTAS_PER_NODE
#define MAX_REFUSED 256
#define STEP_FILE_MAX 4095

void hub_candidates_free(hub_candidate *c, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(c[i].rel);
        free(c[i].abs);
        free(c[i].refused);
        index_parse_release(c[i].index);
    }
    free(c);
}

static int64_t mtime_ns(const struct stat *sb)
{
    return (int64_t)sb->st_mtim.tv_sec * 1000000000 + sb->st_mtim.tv_nsec;
}

/* The trusted start of every walk. */
static int open_root(const char *root, int *fd, dl_error *err)
{
    *fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (*fd < 0)
        return dl_fail_errno(err, errno, "cannot open the hub directory %s", root);
    return 0;
}

/* Why an entry of the tree is not read, for the log line that reports it. */
static char *refusal(int rc, const struct stat *sb, const char *want)
{
    char *s = NULL;
    int n;

    if (rc == -ELOOP)
        n = asprintf(&s, "a symbolic link where %s belongs: links are not followed out of the hub tree", want);
    else if (rc == -EISDIR || rc == -ENOTDIR || rc == -EINVAL)
        n = asprintf(&s, "%s where %s belongs: not read", fsu_kind_name(sb->st_mode), want);
    else
        n = asprintf(&s, "cannot open it: %s", strerror(-rc));
    return n < 0 ? NULL : s;
}

typedef struct scan {
    const char *root;
    const hub_index_memo *memo;
    size_t nmemo;
    const hub_scan_opts *opts;  /* NULL: sync */
    hub_candidate *v;
    size_t n, cap, nrefused;
    size_t index_parses;        /* indexes read and parsed (the memo spared the others) */
} scan;

static int push(scan *sc, hub_candidate *c)
{
    if (sc->n == sc->cap) {
        size_t nc = sc->cap ? sc->cap * 2 : 64;
        hub_candidate *nv = realloc(sc->v, nc * sizeof(*nv));
        if (nv == NULL)
            return -ENOMEM;
        sc->v = nv;
        sc->cap = nc;
    }
    sc->v[sc->n++] = *c;
    return 0;
}

static int refused_full(const scan *sc)
{
    return sc->nrefused >= MAX_REFUSED;
}

/* Adds a refused entry; rel and why are owned by the callee from here on. */
static int push_refused(scan *sc, char *rel, char *why, const struct stat *sb)
{
    hub_candidate c = {.rel = rel, .refused = why};
    int rc = -ENOMEM;

    if (rel != NULL && why != NULL && refused_full(sc))
        rc = 0;                 /* the first ones are reported; more of the same junk adds nothing */
    else if (rel != NULL && why != NULL && asprintf(&c.abs, "%s/%s", sc->root, rel) >= 0) {
        c.size = (uint64_t)sb->st_size;
        c.mtime_ns = mtime_ns(sb);
        c.ino = (uint64_t)sb->st_ino;
        if ((rc = push(sc, &c)) == 0) {
            sc->nrefused++;
            return 0;
        }
        free(c.abs);
    }
    free(rel);
    free(why);
    return rc;
}

/* Refuses the entry name of dirfd (rel: its path in the tree), after lstat for its identity. */
static int refuse_entry(scan *sc, int dirfd, const char *name, const char *rel, int why_rc, const char *want)
{
    struct stat sb = {0};

    if (refused_full(sc))
        return 0;
    if (fstatat(dirfd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0)
        return 0;               /* gone since the listing */
    if (why_rc == 0)            /* the caller only knows it is not what it should be */
        why_rc = S_ISLNK(sb.st_mode) ? -ELOOP : -EINVAL;
    return push_refused(sc, strdup(rel), refusal(why_rc, &sb, want), &sb);
}

/* A file in a node directory whose name is not a delta's: a worker's mistake that would otherwise
 * wait unseen forever. */
static int refuse_misnamed(scan *sc, int dirfd, const char *name, const char *rel)
{
    struct stat sb = {0};

    if (refused_full(sc) || fstatat(dirfd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0)
        return 0;
    return push_refused(sc, strdup(rel),
                        strdup("not named like a delta (delta_<local_step>.safetensors, or a set's "
                               "delta_<local_step>.safetensors.index.json and "
                               "delta_<local_step>-<i>-of-<N>.safetensors): ignored"),
                        &sb);
}

typedef struct newest {
    uint64_t step;
    char name[256];
} newest;

/* Keeps the MAX_DELTAS_PER_NODE delta names of highest local step seen so far. */
static void keep_newest(newest *best, size_t *nbest, uint64_t step, const char *name)
{
    size_t slot = *nbest, len = strlen(name);

    if (len >= sizeof(best->name))
        return;
    if (*nbest == MAX_DELTAS_PER_NODE) {
        slot = 0;
        for (size_t i = 1; i < *nbest; i++)
            if (best[i].step < best[slot].step)
                slot = i;
        if (best[slot].step >= step)
            return;
    } else {
        (*nbest)++;
    }
    best[slot].step = step;
    memcpy(best[slot].name, name, len + 1);
}

/* Async: keeps the MAX_DELTAS_PER_NODE delta names of lowest local step seen so far (the caller
 * leaves out those below the resume point).  0 when kept, 1 when one was left out (the new one
 * or the one it displaced): it waits for a later scan. */
static int keep_lowest(newest *best, size_t *nbest, uint64_t step, const char *name)
{
    size_t slot = *nbest, len = strlen(name);

    if (len >= sizeof(best->name))
        return 0;
    if (*nbest == MAX_DELTAS_PER_NODE) {
        slot = 0;
        for (size_t i = 1; i < *nbest; i++)
            if (best[i].step > best[slot].step)
                slot = i;
        if (best[slot].step <= step)
            return 1;
        best[slot].step = step;
        memcpy(best[slot].name, name, len + 1);
        return 1;
    }
    (*nbest)++;
    best[slot].step = step;
    memcpy(best[slot].name, name, len + 1);
    return 0;
}

static int newest_cmp(const void *a, const void *b)
{
    const newest *x = a, *y = b;
    return x->step < y->step ? -1 : x->step > y->step ? 1 : strcmp(x->name, y->name);
}

/* The resume point of node id (0: from the start). */
static uint64_t resume_of(const scan *sc, const char *id)
{
    size_t lo = 0, hi = sc->opts != NULL ? sc->opts->nresume : 0;

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(sc->opts->resume[mid].node, id);
        if (c == 0)
            return sc->opts->resume[mid].from;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return 0;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && memcmp(s + n - m, suffix, m) == 0;
}

static uint64_t fnv_u64(uint64_t h, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ULL;
    return h;
}

/* The shard count an index lists, 0 if it does not parse (or cannot be read as a regular file). */
static uint32_t read_index_count(int dirfd, const char *name, const char *base)
{
    index_parse *p;
    struct stat sb;
    uint32_t n = 0;
    int fd;

    if (fsu_open_file_at(dirfd, name, &fd, &sb) != 0)
        return 0;
    if (index_parse_read(fd, &sb, base, &p) == 0) {
        n = p->nshards;
        index_parse_release(p);
    }
    close(fd);
    return n;
}

static const hub_index_memo *memo_find(const scan *sc, const char *rel)
{
    size_t lo = 0, hi = sc->nmemo;

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(sc->memo[mid].rel, rel);
        if (c == 0)
            return &sc->memo[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* The shards of base (nshards of them) in dirfd, folded into c's identity (see hub_candidate).  Stops
 * at the first one missing: *partial = 1, and a set nobody completes costs one lstat per scan. */
static void fold_shards(int dirfd, const char *base, uint32_t nshards, hub_candidate *c, int *partial)
{
    uint64_t mix = 1469598103934665603ULL;      /* FNV-1a */

    *partial = 0;
    mix = fnv_u64(mix, c->ino);
    for (uint32_t i = 0; i < nshards; i++) {
        char name[ST_INDEX_BASE_MAX + 40];
        struct stat sb;
        if (st_index_shard_name(base, i, nshards, name, sizeof(name)) != 0 ||
            fstatat(dirfd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0) {
            *partial = 1;
            break;
        }
        /* a shard that is not a regular file still counts: intake opens it without following
         * links and refuses it with a reason */
        c->size += (uint64_t)sb.st_size;
        if (mtime_ns(&sb) > c->mtime_ns)
            c->mtime_ns = mtime_ns(&sb);
        mix = fnv_u64(fnv_u64(fnv_u64(mix, (uint64_t)sb.st_ino), (uint64_t)sb.st_size), (uint64_t)mtime_ns(&sb));
    }
    c->ino = mix;
}

/* The verdict on the index name (rel, base; sb its lstat) into *out: the memo's when an earlier scan
 * read this version, else read and parsed now.  Only the keeper (the newest set of its node) keeps
 * the parse itself, for intake, and only while the budget has room.  0 or -ENOMEM. */
static int index_verdict(scan *sc, int dirfd, const char *name, const char *rel, const char *base,
                         const struct stat *sb, int keeper, index_parse **out)
{
    const hub_index_memo *m = memo_find(sc, rel);
    struct stat osb;
    int fd, rc;

    if (m != NULL && index_parse_is_version(m->index, sb)) {
        if (keeper || m->index->ix == NULL) {
            *out = index_parse_ref(m->index);
            return 0;
        }
        /* its node has a newer set now: the parse goes with the old memo, the verdict stays */
        return (*out = index_parse_verdict_of(m->index)) != NULL ? 0 : -ENOMEM;
    }
    if ((rc = fsu_open_file_at(dirfd, name, &fd, &osb)) != 0)
        return index_parse_unopened(sb, rc, out);
    rc = index_parse_read(fd, &osb, base, out);
    close(fd);
    if (rc != 0)
        return rc;
    if ((*out)->status != INDEX_UNREAD)
        sc->index_parses++;
    if (!keeper)
        index_parse_drop(*out);
    else
        (void)index_parse_keep(*out);   /* dropped when the budget has no room: the verdict is enough here */
    return 0;
}

/* A set's index (c holds the index's own identity, sb its lstat): how many shards it lists, whether
 * they are all there, and the identity of the whole set. */
static void look_at_set(scan *sc, int dirfd, const char *name, const struct stat *sb, int keeper, hub_candidate *c)
{
    char base[ST_INDEX_BASE_MAX + 1];
    size_t blen = strlen(name) - strlen(ST_INDEX_SUFFIX);

    c->set = 1;
    if (blen == 0 || blen > ST_INDEX_BASE_MAX)
        return;                 /* nshards 0: handed over for intake to refuse */
    memcpy(base, name, blen);
    base[blen] = '\0';
    if (index_verdict(sc, dirfd, name, c->rel, base, sb, keeper, &c->index) != 0)
        return;                 /* out of memory: as if it did not parse (intake reads it itself) */
    c->nshards = c->index->nshards;
    if (c->nshards > 0)
        fold_shards(dirfd, base, c->nshards, c, &c->partial);
}

/* Which of best[] is the node's newest set (its index kept, index_verdict), or nbest if none. */
static size_t newest_set(const newest *best, size_t nbest)
{
    size_t k = nbest;

    for (size_t i = 0; i < nbest; i++)
        if (ends_with(best[i].name, ST_INDEX_SUFFIX) && (k == nbest || best[i].step > best[k].step))
            k = i;
    return k;
}

/* The node directory itself, for the transport to watch (and, async, to resume). */
static int push_node_dir(scan *sc, const char *id, uint64_t waiting)
{
    hub_candidate c = {.node_dir = 1, .waiting = waiting};

    if (asprintf(&c.rel, "nodes/%s", id) < 0) {
        c.rel = NULL;
        return -ENOMEM;
    }
    if (asprintf(&c.abs, "%s/nodes/%s", sc->root, id) < 0) {
        free(c.rel);
        return -ENOMEM;
    }
    if (push(sc, &c) != 0) {
        free(c.rel);
        free(c.abs);
        return -ENOMEM;
    }
    return 0;
}

/* Lists one node directory (nodefd, consumed). */
static int scan_node(scan *sc, const char *id, int nodefd)
{
    DIR *d = fdopendir(nodefd);
    struct dirent *f;
    newest best[MAX_DELTAS_PER_NODE];
    size_t nbest = 0;
    int rc = 0, async = sc->opts != NULL && sc->opts->async;
    uint64_t from = async ? resume_of(sc, id) : 0, waiting = 0;

    if (d == NULL) {
        rc = -errno;
        close(nodefd);
        return rc;
    }
    while ((f = readdir(d)) != NULL) {
        char rel[300];
        delta_path dp;
        if (f->d_name[0] == '.')
            continue;           /* ., .., and hidden files (a writer's temporary before its rename) */
        if (snprintf(rel, sizeof(rel), "nodes/%s/%s", id, f->d_name) >= (int)sizeof(rel) ||
            delta_parse_any_path(rel, &dp, NULL) != 0) {
            /* a worker that misnames its delta would wait forever: say so (once per file) */
            if ((rc = refuse_misnamed(sc, dirfd(d), f->d_name, rel)) != 0)
                break;
            continue;
        }
        if (dp.kind == DELTA_PATH_SHARD)
            continue;           /* part of a set: looked at through its index, never alone */
        if (!async)
            keep_newest(best, &nbest, dp.local_step, f->d_name);
        else if (dp.local_step >= from)     /* below: decided by earlier scans */
            waiting += (uint64_t)keep_lowest(best, &nbest, dp.local_step, f->d_name);
    }
    if (async && nbest > 1)
        qsort(best, nbest, sizeof(*best), newest_cmp);   /* handed over in local-step order */
    if (rc == 0)
        rc = push_node_dir(sc, id, waiting);
    size_t keeper = newest_set(best, nbest);
    for (size_t i = 0; i < nbest && rc == 0; i++) {
        hub_candidate c = {0};
        struct stat sb;
        char rel[300];
        snprintf(rel, sizeof(rel), "nodes/%s/%s", id, best[i].name);
        /* lstat only: a link, a FIFO or a device is reported, never opened */
        if (fstatat(dirfd(d), best[i].name, &sb, AT_SYMLINK_NOFOLLOW) != 0)
            continue;           /* gone since the listing */
        if (!S_ISREG(sb.st_mode)) {
            rc = refuse_entry(sc, dirfd(d), best[i].name, rel, 0, "a delta file");
            continue;
        }
        if ((c.rel = strdup(rel)) == NULL || asprintf(&c.abs, "%s/%s", sc->root, rel) < 0) {
            free(c.rel);
            rc = -ENOMEM;
            break;
        }
        c.size = (uint64_t)sb.st_size;
        c.mtime_ns = mtime_ns(&sb);
        c.ino = (uint64_t)sb.st_ino;
        c.local_step = best[i].step;
        if (ends_with(best[i].name, ST_INDEX_SUFFIX))
            look_at_set(sc, dirfd(d), best[i].name, &sb, i == keeper, &c);
        if ((rc = push(sc, &c)) != 0) {
            free(c.rel);
            free(c.abs);
            index_parse_release(c.index);
        }
    }
    closedir(d);
    return rc;
}

static int memo_cmp(const void *a, const void *b)
{
    return strcmp(((const hub_index_memo *)a)->rel, ((const hub_index_memo *)b)->rel);
}

void hub_index_memo_free(hub_index_memo *memo, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(memo[i].rel);
        index_parse_release(memo[i].index);
    }
    free(memo);
}

int hub_index_memo_build(const hub_candidate *c, size_t n, hub_index_memo **memo, size_t *nmemo)
{
    hub_index_memo *v = NULL;
    size_t k = 0;

    for (size_t i = 0; i < n; i++) {
        if (!c[i].set || c[i].index == NULL)
            continue;
        if (k % 64 == 0) {
            hub_index_memo *nv = realloc(v, (k + 64) * sizeof(*nv));
            if (nv == NULL)
                goto fail;
            v = nv;
        }
        if ((v[k].rel = strdup(c[i].rel)) == NULL)
            goto fail;
        v[k].index = index_parse_ref(c[i].index);
        k++;
    }
    if (k > 1)
        qsort(v, k, sizeof(*v), memo_cmp);
    hub_index_memo_free(*memo, *nmemo);
    *memo = v;
    *nmemo = k;
    return 0;
fail:
    hub_index_memo_free(v, k);
    return -ENOMEM;
}

int hubfile_scan(const char *root, const hub_index_memo *memo, size_t nmemo, const hub_scan_opts *opts,
                 hub_candidate **out, size_t *count, size_t *index_parses, dl_error *err)
{
    scan sc = {.root = root, .memo = memo, .nmemo = nmemo, .opts = opts};
    DIR *top = NULL;
    struct dirent *e;
    size_t dirs = 0;
    int rc, rootfd, nodesfd;

    *out = NULL;
    *count = 0;
    *index_parses = 0;
    if ((rc = open_root(root, &rootfd, err)) != 0)
        return rc;
    rc = fsu_open_dir_at(rootfd, "nodes", &nodesfd);
    if (rc == -ENOENT) {
        rc = 0;                 /* no worker has written yet */
        goto out;
    }
    if (rc == -ELOOP || rc == -ENOTDIR) {
        rc = refuse_entry(&sc, rootfd, "nodes", "nodes", rc, "the nodes directory");
        goto out;
    }
    if (rc != 0)
        goto out;
    if ((top = fdopendir(nodesfd)) == NULL) {
        rc = -errno;
        close(nodesfd);
        goto out;
    }
    while (rc == 0 && (e = readdir(top)) != NULL) {
        char rel[DELTA_NODE_ID_MAX + 8];
        int nodefd;
        if (!delta_valid_node_id(e->d_name, strlen(e->d_name)))
            continue;
        snprintf(rel, sizeof(rel), "nodes/%s", e->d_name);
        if (e->d_type != DT_DIR && e->d_type != DT_UNKNOWN) {
            /* known from the listing not to be a directory: no open, and once enough are reported
             * no system call at all */
            rc = refuse_entry(&sc, dirfd(top), e->d_name, rel, e->d_type == DT_LNK ? -ELOOP : -ENOTDIR,
                              "a node directory");
            continue;
        }
        if (dirs == MAX_NODE_DIRS) {
            struct stat sb = {0};
            char *why = NULL;
            if (fstat(dirfd(top), &sb) != 0 ||
                asprintf(&why, "more than %d node directories: the others are not read", MAX_NODE_DIRS) < 0)
                why = NULL;
            /* lint-errors: allow alloc: push_refused answers a NULL rel with -ENOMEM */
            rc = push_refused(&sc, strdup("nodes"), why, &sb);
            break;
        }
        rc = fsu_open_dir_at(dirfd(top), e->d_name, &nodefd);
        if (rc == -ENOENT) {
            rc = 0;
            continue;
        }
        if (rc != 0) {
            rc = refuse_entry(&sc, dirfd(top), e->d_name, rel, rc, "a node directory");
            continue;
        }
        dirs++;
        rc = scan_node(&sc, e->d_name, nodefd);
    }
out:
    if (top != NULL)
        closedir(top);
    close(rootfd);
    *index_parses = sc.index_parses;    /* done, whatever became of the scan */
    if (rc != 0) {
        hub_candidates_free(sc.v, sc.n);
        return dl_fail_errno(err, -rc, "scanning %s/nodes", root);
    }
    *out = sc.v;
    *count = sc.n;
    return 0;
}

/* Opens root/global as a directory of the tree, never through a link: *fd = -1 if it is missing. */
static int open_global_dir(const char *root, int rootfd, int *fd, dl_error *err)
{
    struct stat sb = {0};
    char *why;
    int rc = fsu_open_dir_at(rootfd, "global", fd);

    if (rc == 0 || rc == -ENOENT)
        return 0;
    fstatat(rootfd, "global", &sb, AT_SYMLINK_NOFOLLOW);
    why = refusal(rc, &sb, "the global directory");
    rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global is %s", root, why ? why : "unusable");
    free(why);
    return rc;
}

int hubfile_read_published(const char *root, int *present, uint64_t *step, int *sharded, dl_error *err)
{
    char buf[STEP_FILE_MAX + 1];
    const char *model;          /* "global/<name>": the name is model + 7 */
    struct stat sb;
    size_t len;
    int rc, rootfd, gfd = -1, is_sharded = 0;

    *present = 0;
    if (sharded != NULL)
        *sharded = 0;
    if ((rc = open_root(root, &rootfd, err)) != 0)
        return rc;
    if ((rc = open_global_dir(root, rootfd, &gfd, err)) != 0 || gfd < 0)
        goto out;
    rc = fsu_read_small_at(gfd, "step_count.json", buf, STEP_FILE_MAX, &len, &sb);
    if (rc == -ENOENT) {
        rc = 0;
        goto out;
    }
    if (rc == -EFBIG) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s/global/step_count.json is larger than %d bytes", root,
                     STEP_FILE_MAX);
        goto out;
    }
    if (rc != 0) {
        char *why = refusal(rc, &sb, "global/step_count.json");
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global/step_count.json is %s", root, why ? why : "unusable");
        free(why);
        goto out;
    }
    if ((rc = stepcount_parse(buf, len, step, NULL, &is_sharded, err)) != 0)
        goto out;
    model = is_sharded ? STEPCOUNT_MODEL_INDEX : STEPCOUNT_MODEL_SINGLE;
    /* lstat only: the global is opened (safely) when it is adopted */
    if (fstatat(gfd, model + 7, &sb, AT_SYMLINK_NOFOLLOW) != 0) {
        rc = dl_fail_errno(err, errno, "%s/global/step_count.json names step %" PRIu64
                           " but %s cannot be found", root, *step, model);
        goto out;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global/step_count.json names step %" PRIu64
                     " but %s is %s: not read", root, *step, model, fsu_kind_name(sb.st_mode));
        goto out;
    }
    *present = 1;
    if (sharded != NULL)
        *sharded = is_sharded;
out:
    if (gfd >= 0)
        close(gfd);
    close(rootfd);
    return rc;
}

/* Copies size bytes of in (from offset 0) into out. */
/* Bytes copied between two write-back starts.  Every copy here is fsynced right after (the bootstrap's
 * --init-model, an adopted global, a publish), so the disk may as well start on each piece while the
 * next one is copied instead of taking the whole file at the fsync. */
#define COPY_WRITEBACK_BYTES (64u << 20)

static int copy_fd(int in, int out, uint64_t size)
{
    uint64_t done = 0, flushed = 0;

    if (lseek(in, 0, SEEK_SET) < 0)
        return -errno;
    while (done < size) {
        if (done - flushed >= COPY_WRITEBACK_BYTES) {
            /* a hint: a failure shows at the fsync, which writes whatever this did not */
            (void)sync_file_range(out, (off64_t)flushed, (off64_t)(done - flushed), SYNC_FILE_RANGE_WRITE);
            flushed = done;
        }
        size_t want = size - done > COPY_WRITEBACK_BYTES ? COPY_WRITEBACK_BYTES : (size_t)(size - done);
        /* kernel-side copy: no trip through user space, reflinks where the filesystem can */
        ssize_t w = copy_file_range(in, NULL, out, NULL, want, 0);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EXDEV || errno == ENOSYS || errno == EOPNOTSUPP || errno == EINVAL)) {
            char buf[1 << 16];
            ssize_t r = read(in, buf, want < sizeof(buf) ? want : sizeof(buf));
            int rc;
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0)
                return -errno;
            if (r == 0)
                return -ENODATA;        /* it shrank under us */
            if ((rc = fsu_pwrite_all(out, buf, (size_t)r, done)) != 0)
                return rc;
            done += (uint64_t)r;
            continue;
        }
        if (w < 0)
            return -errno;
        if (w == 0)
            return -ENODATA;
        done += (uint64_t)w;
    }
    return 0;
}

/* Copies in (size bytes) to dst atomically; what is the source's name in messages. */
static int copy_to_path(int in, uint64_t size, const char *what, const char *dst, dl_error *err)
{
    char *tmp = NULL;
    int out, rc;

    if ((rc = fsu_tmp_create(dst, &tmp, &out, err)) != 0)
        return rc;
    if ((rc = copy_fd(in, out, size)) != 0) {
        close(out);
        unlink(tmp);
        rc = dl_fail_errno(err, -rc, "copying %s to %s", what, tmp);
    } else {
        rc = fsu_commit_tmp(out, tmp, dst, err);
    }
    free(tmp);
    return rc;
}

int hubfile_copy(const char *src, const char *dst, dl_error *err)
{
    struct stat sb;
    int in, rc;

    in = open(src, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (in < 0)
        return dl_fail_errno(err, errno, "cannot open %s", src);
    if (fstat(in, &sb) != 0)
        rc = dl_fail_errno(err, errno, "cannot stat %s", src);
    else if (!S_ISREG(sb.st_mode))
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s is %s, not a regular file", src, fsu_kind_name(sb.st_mode));
    else
        rc = copy_to_path(in, (uint64_t)sb.st_size, src, dst, err);
    close(in);
    return rc;
}

/* A cheap look at the header before a copy: a file that is not a safetensors model costs its
 * header, not a copy of the whole file into the state directory. */
/* max_header: refused from the 8-byte prefix above it, before the header is read (0: no cap of ours) */
static int check_model_header(int fd, uint64_t size, uint64_t max_header, const char *what, dl_error *err)
{
    unsigned char prefix[8];
    st_header *h = NULL;
    char *json = NULL;
    size_t need;
    int rc;

    if (size < 8)
        return dl_fail(err, DL_E_HEADER_TOO_SMALL, NULL, 0, "%s: file too small: %" PRIu64 " bytes", what, size);
    if ((rc = fsu_pread_all(fd, prefix, 8, 0)) != 0)
        return dl_fail_errno(err, -rc, "cannot read %s", what);
    if ((rc = st_header_parse_prefix((const char *)prefix, 8, size, &need, &h, err)) != 0)
        return rc;
    if (max_header != 0 && need - 8 > max_header)
        return dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                       "%s: a header of %zu bytes, the cap is %" PRIu64 " (max_delta_header_mib)", what, need - 8,
                       max_header);
    if ((json = malloc(need - 8 ? need - 8 : 1)) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory for the header of %s", what);
    if ((rc = fsu_pread_all(fd, json, need - 8, 8)) != 0)
        rc = dl_fail_errno(err, -rc, "cannot read the header of %s", what);
    else
        rc = st_header_parse(json, need - 8, size, &h, err);
    free(json);
    st_header_free(h);
    return rc;
}

int hubfile_copy_global(const char *root, const char *dst, uint64_t max_header, dl_error *err)
{
    struct stat before, after;
    char what[64];
    int rc, rootfd, gfd = -1, in = -1;

    snprintf(what, sizeof(what), "global/latest.safetensors");
    if ((rc = open_root(root, &rootfd, err)) != 0)
        return rc;
    if ((rc = open_global_dir(root, rootfd, &gfd, err)) != 0)
        goto out;
    if (gfd < 0) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global is missing", root);
        goto out;
    }
    if ((rc = fsu_open_file_at(gfd, "latest.safetensors", &in, &before)) != 0) {
        char *why = refusal(rc, &before, what);
        rc = rc == -ENOENT ? dl_fail(err, DL_E_IO, NULL, 0, "%s/%s is missing", root, what)
                           : dl_fail(err, DL_E_IO, NULL, 0, "%s/%s is %s", root, what, why ? why : "unusable");
        free(why);
        goto out;
    }
    if ((rc = check_model_header(in, (uint64_t)before.st_size, max_header, what, err)) != 0)
        goto out;
    if ((rc = copy_to_path(in, (uint64_t)before.st_size, what, dst, err)) != 0)
        goto out;
    /* replaced in place while we copied: our copy may mix two versions; the next scan retries */
    if (fstat(in, &after) != 0 || after.st_size != before.st_size || mtime_ns(&after) != mtime_ns(&before)) {
        unlink(dst);
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/%s changed while it was copied", root, what);
    }
out:
    if (in >= 0)
        close(in);
    if (gfd >= 0)
        close(gfd);
    close(rootfd);
    return rc;
}

int hubfile_remove_dir(const char *dir, dl_error *err)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    int rc = 0;

    if (d == NULL)
        return errno == ENOENT ? 0 : dl_fail_errno(err, errno, "cannot list %s", dir);
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        if (unlinkat(dirfd(d), e->d_name, 0) != 0 && errno != ENOENT && rc == 0)
            rc = dl_fail_errno(err, errno, "cannot remove %s/%s", dir, e->d_name);
    }
    closedir(d);
    if (rc == 0 && rmdir(dir) != 0 && errno != ENOENT)
        rc = dl_fail_errno(err, errno, "cannot remove %s", dir);
    return rc;
}

/* Copies root/global/name (gfd) to dir/name: a regular file reached without links, whose header
 * parses, that did not change during the copy. */
static int copy_global_file(int gfd, const char *root, const char *name, const char *dir, uint64_t max_header,
                            dl_error *err)
{
    struct stat before, after;
    char what[128], *dst = NULL;
    int rc, in = -1;

    snprintf(what, sizeof(what), "global/%s", name);
    if ((rc = fsu_open_file_at(gfd, name, &in, &before)) != 0) {
        char *why = refusal(rc, &before, what);
        rc = rc == -ENOENT ? dl_fail(err, DL_E_IO, NULL, 0, "%s/%s is missing", root, what)
                           : dl_fail(err, DL_E_IO, NULL, 0, "%s/%s is %s", root, what, why ? why : "unusable");
        free(why);
        return rc;
    }
    if (asprintf(&dst, "%s/%s", dir, name) < 0) {
        dst = NULL;
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = check_model_header(in, (uint64_t)before.st_size, max_header, what, err)) != 0 ||
        (rc = copy_to_path(in, (uint64_t)before.st_size, what, dst, err)) != 0)
        goto out;
    if (fstat(in, &after) != 0 || after.st_size != before.st_size || mtime_ns(&after) != mtime_ns(&before))
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/%s changed while it was copied", root, what);
out:
    free(dst);
    close(in);
    return rc;
}

int hubfile_copy_global_set(const char *root, const char *dir, uint64_t max_header, dl_error *err)
{
    static const char index_name[] = "latest" ST_INDEX_SUFFIX;
    char *buf = NULL, *ipath = NULL;
    st_index *ix = NULL;
    st_set *set = NULL;
    struct stat sb;
    size_t len;
    int rc, rootfd, gfd = -1;

    if ((rc = hubfile_remove_dir(dir, err)) != 0 || (rc = fsu_mkdirs(dir, err)) != 0)
        return rc;
    if ((rc = open_root(root, &rootfd, err)) != 0)
        return rc;
    if ((rc = open_global_dir(root, rootfd, &gfd, err)) != 0)
        goto out;
    if (gfd < 0) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global is missing", root);
        goto out;
    }
    if ((buf = malloc((size_t)ST_INDEX_MAX_BYTES + 1)) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    /* the index read once: the bytes parsed are the bytes copied */
    if ((rc = fsu_read_small_at(gfd, index_name, buf, ST_INDEX_MAX_BYTES, &len, &sb)) != 0) {
        char *why = refusal(rc, &sb, "global/latest" ST_INDEX_SUFFIX);
        rc = rc == -EFBIG ? dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0, "%s/global/%s is larger than %u bytes", root,
                                    index_name, ST_INDEX_MAX_BYTES)
                          : dl_fail(err, DL_E_IO, NULL, 0, "%s/global/%s is %s", root, index_name,
                                    why ? why : "unusable");
        free(why);
        goto out;
    }
    if ((rc = st_index_parse(buf, len, "latest", &ix, err)) != 0)
        goto out;
    for (uint32_t i = 0; i < ix->nshards && rc == 0; i++) {
        char name[64];
        if (st_index_shard_name("latest", i, ix->nshards, name, sizeof(name)) != 0)
            rc = dl_fail(err, DL_E_INVALID_PATH, NULL, 0, "a shard name of %u does not fit", ix->nshards);
        else
            rc = copy_global_file(gfd, root, name, dir, max_header, err);
    }
    if (rc != 0)
        goto out;
    if (asprintf(&ipath, "%s/%s", dir, index_name) < 0) {
        ipath = NULL;
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = fsu_write_atomic(ipath, buf, len, err)) != 0)
        goto out;
    /* the shards and the index agree (every tensor where the index says, total_size); the daemon
     * validates the model itself */
    if ((rc = st_set_open(ipath, &set, err)) == 0)
        st_set_close(set);
out:
    st_index_free(ix);
    free(ipath);
    free(buf);
    if (gfd >= 0)
        close(gfd);
    close(rootfd);
    if (rc != 0) {
        dl_error ignored;
        hubfile_remove_dir(dir, &ignored);
    }
    return rc;
}

/* Zero-copy publish: hard-links in (our own file) into root/global under a temporary name and renames
 * it over name.  The published file then shares its inode with the state's: global/ is written only by
 * aggregators, always by rename, never in place.  Its data is not waited for here: the step is committed
 * by its redo record, the settle makes the same inode durable in the background, and a restart that
 * recovers the step from its redo record publishes it again (a crash of the machine may have lost what
 * the tree showed).  0, 1 when a link is not possible here (another filesystem, links refused: the caller
 * copies), or a negative code with err set. */
static int publish_linked(int gfd, int in, const char *root, const char *name, dl_error *err)
{
    char tmp[96];
    static unsigned counter;
    int rc;

    snprintf(tmp, sizeof(tmp), ".%.40s.tmp-%d-l%u", name, (int)getpid(),
             __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED));
    if ((rc = fsu_link_fd(in, gfd, tmp)) != 0)
        return rc == EXDEV || rc == EPERM || rc == EMLINK || rc == ENOENT ? 1
               : dl_fail_errno(err, rc, "cannot link into %s/global", root);
    if (renameat(gfd, tmp, gfd, name) != 0) {
        rc = dl_fail_errno(err, errno, "publishing %s/global/%s", root, name);
        unlinkat(gfd, tmp, 0);
        return rc;
    }
    /* where name already was a link to this very file (the same step published again, or a global
     * linked from an --init-model that is this tree's own file), rename(2) does nothing and leaves tmp */
    unlinkat(gfd, tmp, 0);
    if (fsync(gfd) != 0)
        return dl_fail_errno(err, errno, "fsync of %s/global", root);
    return 0;
}

/* Publishes src (a trusted path: our own state) as root/global/name atomically (gfd: root/global):
 * linked where the filesystems allow, else copied. */
static int publish_one(int gfd, const char *root, const char *src, const char *name, dl_error *err)
{
    struct stat sb;
    char *tmp = NULL;
    int rc, in, out;

    if ((in = open(src, O_RDONLY | O_CLOEXEC)) < 0)
        return dl_fail_errno(err, errno, "cannot open %s", src);
    if (fstat(in, &sb) != 0) {
        rc = dl_fail_errno(err, errno, "cannot stat %s", src);
        goto out;
    }
    if ((rc = publish_linked(gfd, in, root, name, err)) <= 0)
        goto out;
    if ((rc = fsu_tmp_create_at(gfd, name, &tmp, &out)) != 0) {
        rc = dl_fail_errno(err, -rc, "cannot create a temporary file in %s/global", root);
        goto out;
    }
    if ((rc = copy_fd(in, out, (uint64_t)sb.st_size)) != 0) {
        close(out);
        unlinkat(gfd, tmp, 0);
        rc = dl_fail_errno(err, -rc, "copying %s to %s/global/%s", src, root, tmp);
        goto out;
    }
    if ((rc = fsu_commit_tmp_at(gfd, out, tmp, name)) != 0)
        rc = dl_fail_errno(err, -rc, "publishing %s/global/%s", root, name);
out:
    free(tmp);
    close(in);
    return rc;
}

/* Publishes the set whose index is src: the shards it lists (from src's directory, named
 * latest-0000i-of-0000N.safetensors), then the index, each atomically.  *nshards: N. */
static int publish_set(int gfd, const char *root, const char *src, uint32_t *nshards, dl_error *err)
{
    const char *slash = strrchr(src, '/');
    size_t dlen = slash != NULL ? (size_t)(slash - src) : 0;
    st_index *ix = NULL;
    char *path = NULL;
    int rc;

    if ((rc = st_index_load(src, &ix, err)) != 0)
        return rc;
    /* the published names are latest-*: an index of another base would name shards that are not there */
    if (strcmp(ix->base, "latest") != 0) {
        rc = dl_fail(err, DL_E_INVALID_PATH, NULL, 0, "%s: a published set is latest" ST_INDEX_SUFFIX
                     ", not %s" ST_INDEX_SUFFIX, src, ix->base);
        goto out;
    }
    for (uint32_t i = 0; i < ix->nshards && rc == 0; i++) {
        char name[64];
        if (st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name)) != 0 ||
            asprintf(&path, "%.*s%s%s", (int)dlen, src, slash != NULL ? "/" : "", name) < 0) {
            path = NULL;
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            break;
        }
        rc = publish_one(gfd, root, path, name, err);
        free(path);
        path = NULL;
    }
    if (rc == 0)
        rc = publish_one(gfd, root, src, "latest" ST_INDEX_SUFFIX, err);
    *nshards = ix->nshards;
out:
    st_index_free(ix);
    return rc;
}

/* After step_count.json names the new layout: removes the other one's files from root/global (the
 * plain latest.safetensors when nshards > 0, the index when 0, shards of any count but nshards).
 * The step is published already: a file that cannot be removed is logged, not a failure. */
static void remove_other_layout(int gfd, const char *root, uint32_t nshards)
{
    int fd = dup(gfd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    struct dirent *e;

    if (d == NULL) {
        if (fd >= 0)
            close(fd);
        dl_log(DL_LOG_WARN, "hub", "cannot list the global directory to remove the previous layout",
               "dir=%s/global errno=%d", root, errno);
        return;
    }
    while ((e = readdir(d)) != NULL) {
        char base[ST_INDEX_BASE_MAX + 1];
        uint32_t i, n;
        struct stat sb;
        st_name_kind k = st_index_classify(e->d_name, strlen(e->d_name), base, &i, &n);
        int drop = k == ST_NAME_SINGLE   ? nshards > 0
                   : k == ST_NAME_INDEX ? nshards == 0
                   : k == ST_NAME_SHARD ? n != nshards
                                        : 0;
        if (!drop || strcmp(base, "latest") != 0)
            continue;
        /* never a directory someone made under the name (unlinkat would refuse it anyway) */
        if (fstatat(dirfd(d), e->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0 || S_ISDIR(sb.st_mode))
            continue;
        if (unlinkat(dirfd(d), e->d_name, 0) != 0 && errno != ENOENT)
            dl_log(DL_LOG_WARN, "hub", "cannot remove a file of the previous layout", "path=%s/global/%s errno=%d",
                   root, e->d_name, errno);
    }
    closedir(d);
}

int hubfile_publish(const char *root, const char *src, uint64_t step, const char *optimizer, int bootstrap,
                    dl_error *err)
{
    char *text = NULL;
    uint32_t nshards = 0;
    int rc, rootfd, gfd = -1, sharded = st_index_is_index_path(src);

    if ((rc = open_root(root, &rootfd, err)) != 0)
        return rc;
    if ((rc = open_global_dir(root, rootfd, &gfd, err)) != 0)
        goto out;
    if (gfd < 0) {
        /* mkdirat never follows a link planted under the name: EEXIST, then the open refuses it */
        if (mkdirat(rootfd, "global", 0755) != 0 && errno != EEXIST) {
            rc = dl_fail_errno(err, errno, "cannot create %s/global", root);
            goto out;
        }
        if ((rc = open_global_dir(root, rootfd, &gfd, err)) != 0)
            goto out;
        if (gfd < 0) {
            rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global vanished while it was created", root);
            goto out;
        }
    }
    rc = sharded ? publish_set(gfd, root, src, &nshards, err) : publish_one(gfd, root, src, "latest.safetensors", err);
    if (rc != 0)
        goto out;
    /* last: a reader never sees a step whose model is not all there */
    text = stepcount_build(step, optimizer, bootstrap, sharded, NULL);
    if (text == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = fsu_write_atomic_at(gfd, "step_count.json", text, strlen(text))) != 0) {
        rc = dl_fail_errno(err, -rc, "publishing %s/global/step_count.json", root);
        goto out;
    }
    remove_other_layout(gfd, root, nshards);
out:
    free(text);
    if (gfd >= 0)
        close(gfd);
    close(rootfd);
    return rc;
}

/* Removes the set whose index is name in nodefd if its identity (hub_candidate) is still the one
 * given.  The index goes first: from then on no scan sees the set, whatever is left of it. */
static int remove_set_at(int nodefd, const char *root, const char *rel, const char *name, uint64_t size,
                         int64_t mtime, uint64_t ino, dl_error *err)
{
    char base[ST_INDEX_BASE_MAX + 1];
    size_t blen = strlen(name) - strlen(ST_INDEX_SUFFIX);
    hub_candidate c = {0};
    struct stat sb;
    int partial;

    if (fstatat(nodefd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0)
        return errno == ENOENT ? 0 : dl_fail_errno(err, errno, "cannot stat %s/%s", root, rel);
    if (!S_ISREG(sb.st_mode) || blen == 0 || blen > ST_INDEX_BASE_MAX)
        return 1;
    memcpy(base, name, blen);
    base[blen] = '\0';
    c.size = (uint64_t)sb.st_size;
    c.mtime_ns = mtime_ns(&sb);
    c.ino = (uint64_t)sb.st_ino;
    if ((c.nshards = read_index_count(nodefd, name, base)) == 0)
        return 1;               /* rewritten into something else since it was taken in */
    fold_shards(nodefd, base, c.nshards, &c, &partial);
    if (partial || c.size != size || c.mtime_ns != mtime || c.ino != ino)
        return 1;
    if (unlinkat(nodefd, name, 0) != 0 && errno != ENOENT)
        return dl_fail_errno(err, errno, "cannot remove %s/%s", root, rel);
    for (uint32_t i = 0; i < c.nshards; i++) {
        char shard[ST_INDEX_BASE_MAX + 40];
        if (st_index_shard_name(base, i, c.nshards, shard, sizeof(shard)) != 0)
            continue;
        if (unlinkat(nodefd, shard, 0) != 0 && errno != ENOENT)
            return dl_fail_errno(err, errno, "cannot remove a shard of %s/%s: %s", root, rel, shard);
    }
    return 0;
}

int hubfile_remove_delta(const char *root, const char *rel, uint64_t size, int64_t mtime, uint64_t ino,
                         dl_error *err)
{
    delta_path dp;
    const char *name;
    struct stat sb;
    int rc, rootfd, nodesfd = -1, nodefd = -1;

    /* only a strictly parsed delta path: nodes/<id>/delta_<n>.safetensors or a set's index, nothing else */
    if (delta_parse_any_path(rel, &dp, NULL) != 0 || dp.kind == DELTA_PATH_SHARD || (name = strrchr(rel, '/')) == NULL)
        return dl_fail(err, DL_E_INVALID_PATH, NULL, 0, "not a delta path: %.200s", rel);
    name++;
    if ((rc = open_root(root, &rootfd, err)) != 0)
        return rc;
    if ((rc = fsu_open_dir_at(rootfd, "nodes", &nodesfd)) != 0 ||
        (rc = fsu_open_dir_at(nodesfd, dp.node_id, &nodefd)) != 0) {
        rc = rc == -ENOENT ? 0 : dl_fail_errno(err, -rc, "cannot open %s/nodes/%s", root, dp.node_id);
        goto out;
    }
    if (dp.kind == DELTA_PATH_INDEX) {
        rc = remove_set_at(nodefd, root, rel, name, size, mtime, ino, err);
        goto out;
    }
    if (fstatat(nodefd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0) {
        rc = errno == ENOENT ? 0 : dl_fail_errno(err, errno, "cannot stat %s/%s", root, rel);
        goto out;
    }
    /* the version that was taken in, and no other: a worker's newer file under the name stays */
    if (!S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != size || mtime_ns(&sb) != mtime || (uint64_t)sb.st_ino != ino) {
        rc = 1;
        goto out;
    }
    if (unlinkat(nodefd, name, 0) != 0 && errno != ENOENT)
        rc = dl_fail_errno(err, errno, "cannot remove %s/%s", root, rel);
out:
    if (nodefd >= 0)
        close(nodefd);
    if (nodesfd >= 0)
        close(nodesfd);
    close(rootfd);
    return rc;
}

int hubfile_cleanup_temps(const char *root, dl_error *err)
{
    DIR *d;
    struct dirent *e;
    int rc, rootfd, gfd;

    if ((rc = open_root(root, &rootfd, err)) != 0)
        return rc;
    rc = open_global_dir(root, rootfd, &gfd, err);
    close(rootfd);
    if (rc != 0 || gfd < 0)
        return rc;
    if ((d = fdopendir(gfd)) == NULL) {
        rc = dl_fail_errno(err, errno, "cannot list %s/global", root);
        close(gfd);
        return rc;
    }
    while ((e = readdir(d)) != NULL) {
        /* our temporary names only (fsu_tmp_create_at ".<name>.tmp-..."): what a publish cut short
         * left behind, of latest.safetensors, the index, a shard or step_count.json */
        if (strncmp(e->d_name, ".latest.", 8) != 0 && strncmp(e->d_name, ".latest-", 8) != 0 &&
            strncmp(e->d_name, ".step_count.json.tmp-", 21) != 0)
            continue;
        if (strstr(e->d_name, ".tmp-") == NULL)
            continue;
        if (unlinkat(dirfd(d), e->d_name, 0) != 0 && errno != ENOENT)
            rc = dl_fail_errno(err, errno, "cannot remove %s/global/%s", root, e->d_name);
    }
    closedir(d);
    return rc;
}
