/* hub_file_downlink: the downlink's files in a file:// tree (hub_file.h; README, "The downlink"):
 *   global/updates/<s>.safetensors   each step's update, the last `keep` kept
 *   global/views/<c>.safetensors     a view checkpoint every keep/2 steps (and at the chain's first step),
 *                                    the last two kept: a joiner takes the newest and replays the updates
 *                                    after it, which the tree still holds (c > step - keep)
 * Written before step_count.json names them, removed after it names newer ones. */
#include "hub_file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dl_log.h"

#include "hub_file_internal.h"

/* dir (updates, views) of gfd, made if absent; never a link (O_NOFOLLOW).  0, or -code. */
static int open_sub(int gfd, const char *root, const char *dir, int *fd, dl_error *err)
{
    if (mkdirat(gfd, dir, 0755) != 0 && errno != EEXIST)
        return dl_fail_errno(err, errno, "cannot create %s/global/%s", root, dir);
    if ((*fd = openat(gfd, dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0)
        return dl_fail_errno(err, errno, "cannot open %s/global/%s (a directory, not a link)", root, dir);
    return 0;
}

static int present(int dfd, uint64_t step)
{
    char name[48];
    struct stat sb;
    snprintf(name, sizeof(name), "%" PRIu64 ".safetensors", step);
    return fstatat(dfd, name, &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(sb.st_mode);
}

static int put(int dfd, const char *root, const char *src, uint64_t step, dl_error *err)
{
    char name[48];
    snprintf(name, sizeof(name), "%" PRIu64 ".safetensors", step);
    return hubfile__publish_one(dfd, root, src, name, err);
}

static uint64_t half_of(const hub_downlink *dl)
{
    return dl->keep >= 2 ? dl->keep / 2 : 1;
}

int hubfile_publish_downlink(int gfd, const char *root, const hub_downlink *dl, uint64_t *view_step, dl_error *err)
{
    const uint64_t half = half_of(dl);
    uint64_t c = dl->step - dl->step % half;
    int ufd = -1, vfd = -1, rc;

    if (c < dl->chain_from)
        c = dl->chain_from;
    if ((rc = open_sub(gfd, root, "updates", &ufd, err)) != 0 || (rc = open_sub(gfd, root, "views", &vfd, err)) != 0)
        goto out;
    /* the step's update (replacing one an older chain left under its name) */
    if (dl->update_path != NULL && (rc = put(ufd, root, dl->update_path, dl->step, err)) != 0)
        goto out;
    /* and the kept ones the tree lacks (a publish that failed, or a restart, skipped their steps): the
     * state names them update-<k>.safetensors beside this one */
    const char *slash = dl->update_path != NULL ? strrchr(dl->update_path, '/') : NULL;
    for (uint64_t k = dl->step > dl->keep ? dl->step - dl->keep + 1 : 0; slash != NULL && k < dl->step; k++) {
        char src[4096];
        if (k <= dl->chain_from || present(ufd, k))
            continue;
        int n = snprintf(src, sizeof(src), "%.*s/update-%" PRIu64 ".safetensors", (int)(slash - dl->update_path),
                         dl->update_path, k);
        if (n < 0 || (size_t)n >= sizeof(src) || access(src, R_OK) != 0)
            continue;
        if ((rc = put(ufd, root, src, k, err)) != 0)
            goto out;
    }
    /* the checkpoint: this step's view when it is one, or when the tree lacks the one due (a publish
     * that failed or a restart skipped it): then this step is the newest checkpoint */
    if (c == dl->step || !present(vfd, c)) {
        c = dl->step;
        if ((rc = put(vfd, root, dl->view_path, c, err)) != 0)
            goto out;
    }
    *view_step = c;
out:
    if (ufd >= 0)
        close(ufd);
    if (vfd >= 0)
        close(vfd);
    return rc;
}

/* Removes from dir the <k>.safetensors with k < first, and any with k > last (an abandoned chain's). */
static void prune_dir(int gfd, const char *root, const char *dir, uint64_t first, uint64_t last)
{
    int fd = openat(gfd, dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    struct dirent *e;

    if (d == NULL) {
        if (fd >= 0)
            close(fd);
        return;
    }
    while ((e = readdir(d)) != NULL) {
        uint64_t k = 0;
        const char *p = e->d_name;
        size_t n = strlen(p), digits = 0;
        if (n <= strlen(".safetensors") || strcmp(p + n - strlen(".safetensors"), ".safetensors") != 0)
            continue;
        for (; digits < n - strlen(".safetensors") && p[digits] >= '0' && p[digits] <= '9' && k < UINT64_MAX / 10;
             digits++)
            k = k * 10 + (uint64_t)(p[digits] - '0');
        if (digits != n - strlen(".safetensors") || (k >= first && k <= last))
            continue;
        if (unlinkat(dirfd(d), p, 0) != 0 && errno != ENOENT)
            dl_log(DL_LOG_WARN, "hub", "cannot remove an old downlink file", "path=%s/global/%s/%s errno=%d", root, dir,
                   p, errno);
    }
    closedir(d);
}

void hubfile_prune_downlink(int gfd, const char *root, const hub_downlink *dl, uint64_t view_step)
{
    const uint64_t half = half_of(dl);
    uint64_t ufirst = dl->step + 1 > dl->keep ? dl->step + 1 - dl->keep : 0;
    uint64_t vfirst = view_step >= half ? view_step - half : 0;

    if (ufirst <= dl->chain_from)
        ufirst = dl->chain_from + 1;
    if (vfirst < dl->chain_from)
        vfirst = dl->chain_from;
    prune_dir(gfd, root, "updates", ufirst, dl->step);
    prune_dir(gfd, root, "views", vfirst, dl->step);
}
