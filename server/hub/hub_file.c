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
#include "fsutil.h"
#include "safetensors.h"
#include "stepcount.h"

/* Work and memory per scan stay bounded whatever a writer plants: node directories read (twice the
 * most nodes a round can have; a writer who makes more can hide the rest, and that is logged), delta
 * files looked at per node directory (the newest by local step: one delta per node counts, and a
 * lower local step than one already taken is refused anyway), and refused entries reported.
 * Entries whose names are not valid cost one directory record each and nothing else. */
#define MAX_NODE_DIRS 8192
#define MAX_DELTAS_PER_NODE 16
#define MAX_REFUSED 256
#define STEP_FILE_MAX 4095

void hub_candidates_free(hub_candidate *c, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(c[i].rel);
        free(c[i].abs);
        free(c[i].refused);
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
    hub_candidate *v;
    size_t n, cap, nrefused;
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
    return push_refused(sc, strdup(rel), strdup("not named like a delta (delta_<local_step>.safetensors): ignored"),
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

/* The node directory itself, for the transport to watch. */
static int push_node_dir(scan *sc, const char *id)
{
    hub_candidate c = {.node_dir = 1};

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
    int rc = 0;

    if (d == NULL) {
        rc = -errno;
        close(nodefd);
        return rc;
    }
    while ((f = readdir(d)) != NULL) {
        char rel[300], pid[DELTA_NODE_ID_MAX + 1];
        uint64_t step;
        if (f->d_name[0] == '.')
            continue;           /* ., .., and hidden files (a writer's temporary before its rename) */
        if (snprintf(rel, sizeof(rel), "nodes/%s/%s", id, f->d_name) >= (int)sizeof(rel) ||
            delta_parse_path(rel, pid, &step, NULL) != 0) {
            /* a worker that misnames its delta would wait forever: say so (once per file) */
            if ((rc = refuse_misnamed(sc, dirfd(d), f->d_name, rel)) != 0)
                break;
            continue;
        }
        keep_newest(best, &nbest, step, f->d_name);
    }
    if (rc == 0)
        rc = push_node_dir(sc, id);
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
        if ((rc = push(sc, &c)) != 0) {
            free(c.rel);
            free(c.abs);
        }
    }
    closedir(d);
    return rc;
}

int hubfile_scan(const char *root, hub_candidate **out, size_t *count, dl_error *err)
{
    scan sc = {.root = root};
    DIR *top = NULL;
    struct dirent *e;
    size_t dirs = 0;
    int rc, rootfd, nodesfd;

    *out = NULL;
    *count = 0;
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

int hubfile_read_published(const char *root, int *present, uint64_t *step, dl_error *err)
{
    char buf[STEP_FILE_MAX + 1];
    struct stat sb;
    size_t len;
    int rc, rootfd, gfd = -1;

    *present = 0;
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
    if ((rc = stepcount_parse(buf, len, step, NULL, NULL, err)) != 0)
        goto out;
    /* lstat only: the global is opened (safely) when it is adopted */
    if (fstatat(gfd, "latest.safetensors", &sb, AT_SYMLINK_NOFOLLOW) != 0) {
        rc = dl_fail_errno(err, errno, "%s/global/step_count.json names step %" PRIu64
                           " but global/latest.safetensors cannot be found", root, *step);
        goto out;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global/step_count.json names step %" PRIu64
                     " but global/latest.safetensors is %s: not read", root, *step, fsu_kind_name(sb.st_mode));
        goto out;
    }
    *present = 1;
out:
    if (gfd >= 0)
        close(gfd);
    close(rootfd);
    return rc;
}

/* Copies size bytes of in (from offset 0) into out. */
static int copy_fd(int in, int out, uint64_t size)
{
    uint64_t done = 0;

    if (lseek(in, 0, SEEK_SET) < 0)
        return -errno;
    while (done < size) {
        size_t want = size - done > (1u << 30) ? (1u << 30) : (size_t)(size - done);
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
static int check_model_header(int fd, uint64_t size, const char *what, dl_error *err)
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

int hubfile_copy_global(const char *root, const char *dst, dl_error *err)
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
    if ((rc = check_model_header(in, (uint64_t)before.st_size, what, err)) != 0)
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

int hubfile_publish(const char *root, const char *src, uint64_t step, const char *optimizer, int bootstrap,
                    dl_error *err)
{
    struct stat sb;
    char *text = NULL, *tmp = NULL;
    int rc, rootfd, gfd = -1, in = -1, out;

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
    if ((in = open(src, O_RDONLY | O_CLOEXEC)) < 0 || fstat(in, &sb) != 0) {
        rc = dl_fail_errno(err, errno, "cannot open %s", src);
        goto out;
    }
    if ((rc = fsu_tmp_create_at(gfd, "latest.safetensors", &tmp, &out)) != 0) {
        rc = dl_fail_errno(err, -rc, "cannot create a temporary file in %s/global", root);
        goto out;
    }
    if ((rc = copy_fd(in, out, (uint64_t)sb.st_size)) != 0) {
        close(out);
        unlinkat(gfd, tmp, 0);
        rc = dl_fail_errno(err, -rc, "copying %s to %s/global/%s", src, root, tmp);
        goto out;
    }
    if ((rc = fsu_commit_tmp_at(gfd, out, tmp, "latest.safetensors")) != 0) {
        rc = dl_fail_errno(err, -rc, "publishing %s/global/latest.safetensors", root);
        goto out;
    }
    text = stepcount_build(step, optimizer, bootstrap, 0, NULL);
    if (text == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = fsu_write_atomic_at(gfd, "step_count.json", text, strlen(text))) != 0)
        rc = dl_fail_errno(err, -rc, "publishing %s/global/step_count.json", root);
out:
    free(tmp);
    free(text);
    if (in >= 0)
        close(in);
    if (gfd >= 0)
        close(gfd);
    close(rootfd);
    return rc;
}

int hubfile_remove_delta(const char *root, const char *rel, uint64_t size, int64_t mtime, uint64_t ino,
                         dl_error *err)
{
    char node[DELTA_NODE_ID_MAX + 1];
    const char *name;
    uint64_t step;
    struct stat sb;
    int rc, rootfd, nodesfd = -1, nodefd = -1;

    /* only a strictly parsed delta path: nodes/<id>/delta_<n>.safetensors, nothing else is removed */
    if (delta_parse_path(rel, node, &step, NULL) != 0 || (name = strrchr(rel, '/')) == NULL)
        return dl_fail(err, DL_E_INVALID_PATH, NULL, 0, "not a delta path: %.200s", rel);
    name++;
    if ((rc = open_root(root, &rootfd, err)) != 0)
        return rc;
    if ((rc = fsu_open_dir_at(rootfd, "nodes", &nodesfd)) != 0 || (rc = fsu_open_dir_at(nodesfd, node, &nodefd)) != 0) {
        rc = rc == -ENOENT ? 0 : dl_fail_errno(err, -rc, "cannot open %s/nodes/%s", root, node);
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
        /* our temporary names only (fsu_tmp_create_at): what a publish cut short left behind */
        if (strncmp(e->d_name, ".latest.safetensors.tmp-", 24) != 0 &&
            strncmp(e->d_name, ".step_count.json.tmp-", 21) != 0)
            continue;
        if (unlinkat(dirfd(d), e->d_name, 0) != 0 && errno != ENOENT)
            rc = dl_fail_errno(err, errno, "cannot remove %s/global/%s", root, e->d_name);
    }
    closedir(d);
    return rc;
}
