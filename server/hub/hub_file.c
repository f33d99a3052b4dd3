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
#include "hub_file_internal.h"

/* Work and memory per scan stay bounded whatever a writer plants: node directories read (twice the
 * most nodes a round can have; a writer who makes more can hide the rest, and that is logged), delta
 * files looked at per node directory (sync: the newest by local step, as one delta per node counts;
 * async: the lowest from the node's resume point, as every delta is an update and the next scan goes
 * on), and refused entries reported.
 * Entries whose names are not valid cost one directory record each and nothing else. */
#define MAX_NODE_DIRS 8192
#define MAX_DELTAS_PER_NODE HUBFILE_DELTAS_PER_NODE
#define MAX_REFUSED 256

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

int64_t hubfile__mtime_ns(const struct stat *sb)
{
    return (int64_t)sb->st_mtim.tv_sec * 1000000000 + sb->st_mtim.tv_nsec;
}

/* The trusted start of every walk. */
int hubfile__open_root(const char *root, int *fd, dl_error *err)
{
    *fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (*fd < 0)
        return dl_fail_errno(err, errno, "cannot open the hub directory %s", root);
    return 0;
}

/* Why an entry of the tree is not read, for the log line that reports it. */
char *hubfile__refusal(int rc, const struct stat *sb, const char *want)
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
        c.mtime_ns = hubfile__mtime_ns(sb);
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
    return push_refused(sc, strdup(rel), hubfile__refusal(why_rc, &sb, want), &sb);
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
uint32_t hubfile__read_index_count(int dirfd, const char *name, const char *base)
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
void hubfile__fold_shards(int dirfd, const char *base, uint32_t nshards, hub_candidate *c, int *partial)
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
        if (hubfile__mtime_ns(&sb) > c->mtime_ns)
            c->mtime_ns = hubfile__mtime_ns(&sb);
        mix = fnv_u64(fnv_u64(fnv_u64(mix, (uint64_t)sb.st_ino), (uint64_t)sb.st_size), (uint64_t)hubfile__mtime_ns(&sb));
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
        hubfile__fold_shards(dirfd, base, c->nshards, c, &c->partial);
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
        c.mtime_ns = hubfile__mtime_ns(&sb);
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
    if ((rc = hubfile__open_root(root, &rootfd, err)) != 0)
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
