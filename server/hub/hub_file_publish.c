/* hub_file_publish: what file:// writes into the tree (hub_file.h): a step published into global/ (linked
 * or copied, a set's shards before its index, step_count.json last, the other layout removed), a consumed
 * delta (or set) removed from its node directory, and the temporaries a crash left. */
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
#include "manifest.h"
#include "safetensors.h"
#include "st_index.h"
#include "stepcount.h"

#include "hub_file_internal.h"

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
int hubfile__publish_one(int gfd, const char *root, const char *src, const char *name, dl_error *err)
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
    if ((rc = hubfile__copy_fd(in, out, (uint64_t)sb.st_size)) != 0) {
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
        rc = hubfile__publish_one(gfd, root, path, name, err);
        free(path);
        path = NULL;
    }
    if (rc == 0)
        rc = hubfile__publish_one(gfd, root, src, "latest" ST_INDEX_SUFFIX, err);
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

/* Copies one of the state's record files (ours) into rounds/ of the tree as name. */
static int publish_record_file(int rfd, const char *root, const char *src, const char *name, dl_error *err)
{
    char *buf = malloc(MANIFEST_MAX + 1), *dir = strdup(src), *slash = NULL;
    size_t len = 0;
    struct stat sb;
    int rc, dfd = -1;

    if (buf == NULL || dir == NULL || (slash = strrchr(dir, '/')) == NULL) {
        free(buf);
        free(dir);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    *slash = '\0';             /* the state's rounds/ directory, then the file in it */
    if ((dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
        rc = dl_fail_errno(err, errno, "cannot open %s", dir);
    else if ((rc = fsu_read_small_at(dfd, slash + 1, buf, MANIFEST_MAX, &len, &sb)) != 0)
        rc = dl_fail_errno(err, -rc, "cannot read the step's record %s", src);
    else if ((rc = fsu_write_atomic_at(rfd, name, buf, len)) != 0)
        rc = dl_fail_errno(err, -rc, "publishing %s/global/rounds/%s", root, name);
    if (dfd >= 0)
        close(dfd);
    free(buf);
    free(dir);
    return rc;
}

/* The step's signed record into global/rounds/ (the signature first: a reader that finds the .json finds
 * its signature), and the record MANIFEST_KEEP steps older removed. */
static int publish_record(int gfd, const char *root, const char *record, uint64_t step, dl_error *err)
{
    char name[48], *sig = NULL;
    int rfd = -1, rc;

    if (mkdirat(gfd, "rounds", 0755) != 0 && errno != EEXIST)
        return dl_fail_errno(err, errno, "cannot create %s/global/rounds", root);
    if ((rc = fsu_open_dir_at(gfd, "rounds", &rfd)) != 0)
        return dl_fail_errno(err, -rc, "cannot open %s/global/rounds", root);
    if (asprintf(&sig, "%s.sig", record) < 0) {
        sig = NULL;
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    snprintf(name, sizeof(name), "%" PRIu64 ".json.sig", step);
    if ((rc = publish_record_file(rfd, root, sig, name, err)) != 0)
        goto out;
    snprintf(name, sizeof(name), "%" PRIu64 ".json", step);
    if ((rc = publish_record_file(rfd, root, record, name, err)) != 0)
        goto out;
    if (step >= MANIFEST_KEEP) {
        snprintf(name, sizeof(name), "%" PRIu64 ".json", step - MANIFEST_KEEP);
        (void)unlinkat(rfd, name, 0);   /* gone already, or never signed */
        snprintf(name, sizeof(name), "%" PRIu64 ".json.sig", step - MANIFEST_KEEP);
        (void)unlinkat(rfd, name, 0);
    }
out:
    free(sig);
    close(rfd);
    return rc;
}

int hubfile_publish(const char *root, const char *src, uint64_t step, const char *optimizer, int bootstrap,
                    const char *record, const hub_downlink *dl, dl_error *err)
{
    char *text = NULL, view_file[64], update_file[64];
    const char *kv[6];
    size_t nkv = 0;
    uint64_t view_step = 0;
    uint32_t nshards = 0;
    int rc, rootfd, gfd = -1, sharded = st_index_is_index_path(src);

    if ((rc = hubfile__open_root(root, &rootfd, err)) != 0)
        return rc;
    if ((rc = hubfile__open_global_dir(root, rootfd, &gfd, err)) != 0)
        goto out;
    if (gfd < 0) {
        /* mkdirat never follows a link planted under the name: EEXIST, then the open refuses it */
        if (mkdirat(rootfd, "global", 0755) != 0 && errno != EEXIST) {
            rc = dl_fail_errno(err, errno, "cannot create %s/global", root);
            goto out;
        }
        if ((rc = hubfile__open_global_dir(root, rootfd, &gfd, err)) != 0)
            goto out;
        if (gfd < 0) {
            rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global vanished while it was created", root);
            goto out;
        }
    }
    /* the signed record first: a reader that finds the step finds its record (hub.h) */
    if (record != NULL && (rc = publish_record(gfd, root, record, step, err)) != 0)
        goto out;
    rc = sharded ? publish_set(gfd, root, src, &nshards, err) : hubfile__publish_one(gfd, root, src, "latest.safetensors", err);
    if (rc != 0)
        goto out;
    /* the downlink's files before step_count.json names them (README, "The downlink") */
    if (dl != NULL) {
        if ((rc = hubfile_publish_downlink(gfd, root, dl, &view_step, err)) != 0)
            goto out;
        snprintf(view_file, sizeof(view_file), "global/views/%" PRIu64 ".safetensors", view_step);
        snprintf(update_file, sizeof(update_file), "global/updates/%" PRIu64 ".safetensors", step);
        kv[2 * nkv] = "view_file";
        kv[2 * nkv++ + 1] = view_file;
        if (dl->update_path != NULL) {
            kv[2 * nkv] = "update_file";
            kv[2 * nkv++ + 1] = update_file;
        }
        if (dl->view_hash[0] != '\0') {
            kv[2 * nkv] = "view_hash";
            kv[2 * nkv++ + 1] = dl->view_hash;
        }
    }
    /* last: a reader never sees a step whose model is not all there */
    text = stepcount_build_extra(step, optimizer, bootstrap, sharded ? STEPCOUNT_MODEL_INDEX : STEPCOUNT_MODEL_SINGLE,
                                 NULL, kv, nkv);
    if (text == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = fsu_write_atomic_at(gfd, "step_count.json", text, strlen(text))) != 0) {
        rc = dl_fail_errno(err, -rc, "publishing %s/global/step_count.json", root);
        goto out;
    }
    remove_other_layout(gfd, root, nshards);
    if (dl != NULL)
        hubfile_prune_downlink(gfd, root, dl, view_step);
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
    c.mtime_ns = hubfile__mtime_ns(&sb);
    c.ino = (uint64_t)sb.st_ino;
    if ((c.nshards = hubfile__read_index_count(nodefd, name, base)) == 0)
        return 1;               /* rewritten into something else since it was taken in */
    hubfile__fold_shards(nodefd, base, c.nshards, &c, &partial);
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
    if ((rc = hubfile__open_root(root, &rootfd, err)) != 0)
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
    if (!S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != size || hubfile__mtime_ns(&sb) != mtime || (uint64_t)sb.st_ino != ino) {
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

    if ((rc = hubfile__open_root(root, &rootfd, err)) != 0)
        return rc;
    rc = hubfile__open_global_dir(root, rootfd, &gfd, err);
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
