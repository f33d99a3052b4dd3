/* manifest: the signed record of a committed step (manifest.h). */
#include "manifest.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cJSON.h>

#include "blockhash.h"
#include "delta.h"
#include "fsutil.h"
#include "store.h"

void manifest_double(sbuf *b, double v)
{
    char text[40];

    if (!isfinite(v)) {
        sb_str(b, "null");
        return;
    }
    /* the shortest of %.15g .. %.17g that reads back to v: 0.7, not 0.69999999999999996 */
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(text, sizeof(text), "%.*g", prec, v);
        if (strtod(text, NULL) == v)
            break;
    }
    sb_str(b, text);
}

/* One output's hash, on a thread of its own: the outputs are independent files (the global, the
 * momentum: together twice the model), so they hash side by side. */
typedef struct hash_job {
    const char *file;
    unsigned char digest[BLOCKHASH_SIZE];
    uint64_t bytes;
    int rc;
    dl_error err;
} hash_job;

static void *hash_main(void *arg)
{
    hash_job *h = arg;
    struct stat sb;

    dl_error_clear(&h->err);
    if (stat(h->file, &sb) != 0) {
        h->rc = dl_fail_errno(&h->err, errno, "cannot stat %s", h->file);
        return NULL;
    }
    h->bytes = (uint64_t)sb.st_size;
    h->rc = blockhash_path(h->file, h->digest, &h->err);
    return NULL;
}

static int hash_outputs(const manifest_output *outs, size_t n, hash_job *jobs, dl_error *err)
{
    pthread_t *threads = calloc(n ? n : 1, sizeof(*threads));
    unsigned char *started = calloc(n ? n : 1, 1);
    int rc = 0;

    if (threads == NULL || started == NULL) {
        free(threads);
        free(started);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    for (size_t i = 0; i < n; i++)
        jobs[i].file = outs[i].file;
    /* the first on this thread; a thread that cannot start runs here too */
    for (size_t i = 1; i < n; i++)
        started[i] = pthread_create(&threads[i], NULL, hash_main, &jobs[i]) == 0;
    for (size_t i = 0; i < n; i++)
        if (!started[i])
            hash_main(&jobs[i]);
    for (size_t i = 1; i < n; i++)
        if (started[i])
            pthread_join(threads[i], NULL);
    for (size_t i = 0; i < n && rc == 0; i++)
        if (jobs[i].rc != 0) {
            *err = jobs[i].err;
            rc = jobs[i].rc;
        }
    free(threads);
    free(started);
    return rc;
}

/* Writes a new file next to path and renames it over path, without fsync (manifest_sync does it). */
static int write_file(const char *path, const void *p, size_t n, dl_error *err)
{
    char *tmp = NULL;
    int fd, rc;

    if ((rc = fsu_tmp_create(path, &tmp, &fd, err)) != 0)
        return rc;
    if (fsu_pwrite_all(fd, p, n, 0) != 0) {
        rc = dl_fail_errno(err, errno, "cannot write %s", tmp);
        close(fd);
        unlink(tmp);
        free(tmp);
        return rc;
    }
    rc = fsu_rename_tmp(fd, tmp, path, err);
    free(tmp);
    return rc;
}

int manifest_write(const char *state_dir, uint64_t step, const char *skeleton, const manifest_output *outs,
                   size_t nouts, const sign_key *key, char hash[MANIFEST_HASH_HEX], dl_error *err)
{
    return manifest_write_hashes(state_dir, step, skeleton, outs, nouts, key, hash, NULL, err);
}

int manifest_write_hashes(const char *state_dir, uint64_t step, const char *skeleton, const manifest_output *outs,
                          size_t nouts, const sign_key *key, char hash[MANIFEST_HASH_HEX],
                          char (*out_hex)[MANIFEST_HASH_HEX], dl_error *err)
{
    size_t slen = strlen(skeleton);
    hash_job *jobs = calloc(nouts ? nouts : 1, sizeof(*jobs));
    char *dir = store_path_manifest_dir(state_dir), *path = store_path_manifest(state_dir, step, 0);
    char *sig_path = store_path_manifest(state_dir, step, 1), hex[2 * BLOCKHASH_SIZE + 1], *text = NULL;
    unsigned char sig[SIGN_BYTES], digest[BLOCKHASH_SIZE];
    sbuf b = {0};
    int rc;

    if (jobs == NULL || dir == NULL || path == NULL || sig_path == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if (slen < 2 || skeleton[0] != '{' || skeleton[slen - 1] != '}') {
        rc = dl_fail(err, DL_E_INTERNAL, NULL, 0, "the record of step %" PRIu64 " is not a JSON object", step);
        goto out;
    }
    if ((rc = hash_outputs(outs, nouts, jobs, err)) != 0)
        goto out;
    sb_add(&b, skeleton, slen - 1);
    sb_str(&b, ",\"outputs\":{");
    for (size_t i = 0; i < nouts; i++) {
        sb_str(&b, i ? "," : "");
        sb_json_string(&b, outs[i].name, strlen(outs[i].name));
        sb_str(&b, ":{\"path\":");
        if (outs[i].tree_path != NULL)
            sb_json_string(&b, outs[i].tree_path, strlen(outs[i].tree_path));
        else
            sb_str(&b, "null");
        blockhash_hex(jobs[i].digest, hex);
        if (out_hex != NULL)
            memcpy(out_hex[i], hex, MANIFEST_HASH_HEX);
        sb_printf(&b, ",\"block_hash\":\"%s\",\"bytes\":%" PRIu64 "}", hex, jobs[i].bytes);
    }
    sb_str(&b, "}}");
    size_t len = b.len;
    if ((text = sb_take(&b)) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = sign_message(key, text, len, sig, err)) != 0 || (rc = blockhash_bytes(text, len, digest, err)) != 0 ||
        (rc = fsu_mkdirs(dir, err)) != 0)
        goto out;
    /* the signature first: a record is never there without it (a reader takes the .json as the sign) */
    if ((rc = write_file(sig_path, sig, sizeof(sig), err)) != 0 || (rc = write_file(path, text, len, err)) != 0)
        goto out;
    blockhash_hex(digest, hash);
    manifest_prune(state_dir, step);
out:
    free(jobs);
    free(dir);
    free(path);
    free(sig_path);
    free(text);
    return rc;
}

int manifest_sync(const char *state_dir, uint64_t step, dl_error *err)
{
    char *path = store_path_manifest(state_dir, step, 0), *sig_path = store_path_manifest(state_dir, step, 1);
    int rc;

    if (path == NULL || sig_path == NULL)
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    else if ((rc = fsu_fsync_path(sig_path, err)) == 0 && (rc = fsu_fsync_path(path, err)) == 0)
        rc = fsu_fsync_parent(path, err);
    free(path);
    free(sig_path);
    return rc;
}

int manifest_hash_of(const char *state_dir, uint64_t step, char hash[MANIFEST_HASH_HEX], dl_error *err)
{
    char *path = store_path_manifest(state_dir, step, 0);
    unsigned char digest[BLOCKHASH_SIZE];
    int rc;

    if (path == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if (access(path, F_OK) != 0 && errno == ENOENT)
        rc = 1;
    else if ((rc = blockhash_path(path, digest, err)) == 0)
        blockhash_hex(digest, hash);
    free(path);
    return rc;
}

int manifest_output_of(const char *state_dir, uint64_t step, const char *name, char hex[MANIFEST_HASH_HEX],
                       dl_error *err)
{
    char *path = store_path_manifest(state_dir, step, 0), *text = NULL;
    FILE *f;
    size_t n;
    int rc = 1;

    hex[0] = '\0';
    if (path == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if ((f = fopen(path, "rb")) == NULL) {
        rc = errno == ENOENT ? 1 : dl_fail_errno(err, errno, "cannot open %s", path);
        free(path);
        return rc;
    }
    if ((text = malloc(MANIFEST_MAX + 1)) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    } else {
        n = fread(text, 1, MANIFEST_MAX, f);
        text[n] = '\0';
        /* our own record: its outputs' hashes as written (a damaged one gives none: the next record's base is null) */
        cJSON *root = cJSON_ParseWithLength(text, n);
        const cJSON *o = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "outputs"), name);
        const cJSON *h = cJSON_GetObjectItemCaseSensitive(o, "block_hash");
        if (cJSON_IsString(h) && strlen(h->valuestring) == 2 * BLOCKHASH_SIZE) {
            memcpy(hex, h->valuestring, MANIFEST_HASH_HEX);
            rc = 0;
        }
        cJSON_Delete(root);
    }
    fclose(f);
    free(text);
    free(path);
    return rc;
}

/* Links src as dir/name (a file of ours or a cached delta: the same filesystem as the state). */
static int keep_link(const char *src, const char *dir, const char *name, dl_error *err)
{
    char *dst = NULL;
    int rc = 0;

    if (asprintf(&dst, "%s/%s", dir, name) < 0)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if (link(src, dst) != 0 && errno != EEXIST)
        rc = dl_fail_errno(err, errno, "cannot link %s as %s", src, dst);
    free(dst);
    return rc;
}

/* Removes verify/<t> for every kept step t with t + keep <= step (and temporaries of steps before it). */
static void keep_prune(const char *vdir, uint64_t step, unsigned keep)
{
    DIR *d = opendir(vdir);
    struct dirent *e;

    if (d == NULL)
        return;
    while ((e = readdir(d)) != NULL) {
        const char *name = e->d_name[0] == '.' ? e->d_name + 1 : e->d_name;
        char *end, *path = NULL;
        if (e->d_name[0] == '.' && (e->d_name[1] == '\0' || strcmp(e->d_name, "..") == 0))
            continue;
        errno = 0;
        unsigned long long t = strtoull(name, &end, 10);
        int temp = e->d_name[0] == '.';
        if (errno != 0 || end == name || (*end != '\0' && strncmp(end, ".tmp", 4) != 0))
            continue;           /* not ours */
        if ((temp ? t < step : t + keep <= step) && asprintf(&path, "%s/%s", vdir, e->d_name) >= 0) {
            (void)store_remove_tree(path);      /* retried at the next step if it fails */
            free(path);
        }
    }
    closedir(d);
}

int manifest_keep(const char *state_dir, uint64_t step, unsigned keep, const char *global, const char *momentum,
                  const char *accum, char *const *inputs, char *const *nodes, size_t n, dl_error *err)
{
    char *vdir = store_path_verify_dir(state_dir), *dst = store_path_verify_step(state_dir, step), *tmp = NULL;
    char *in = NULL;
    int rc = 0;

    if (vdir == NULL || dst == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if (keep == 0) {
        keep_prune(vdir, UINT64_MAX, 0);
        goto out;
    }
    if (asprintf(&tmp, "%s/.%" PRIu64 ".tmp", vdir, step) < 0 || asprintf(&in, "%s/inputs", tmp) < 0) {
        tmp = in = NULL;
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    (void)store_remove_tree(tmp);       /* a crash's half one */
    if ((rc = fsu_mkdirs(in, err)) != 0 || (rc = keep_link(global, tmp, "global.safetensors", err)) != 0 ||
        (momentum != NULL && (rc = keep_link(momentum, tmp, "momentum.safetensors", err)) != 0) ||
        (accum != NULL && (rc = keep_link(accum, tmp, "accumulator.safetensors", err)) != 0))
        goto out;
    for (size_t i = 0; i < n && rc == 0; i++) {
        char name[DELTA_NODE_ID_MAX + 16];
        size_t l = strlen(inputs[i]);
        if (l > 5 && strcmp(inputs[i] + l - 5, ".json") == 0)
            continue;           /* a set's index: its shards are not kept */
        snprintf(name, sizeof(name), "%s.safetensors", nodes[i]);
        rc = keep_link(inputs[i], in, name, err);
    }
    if (rc != 0)
        goto out;
    (void)store_remove_tree(dst);       /* a recomputed step's, the same files */
    if (rename(tmp, dst) != 0) {
        rc = dl_fail_errno(err, errno, "cannot rename %s to %s", tmp, dst);
        goto out;
    }
    keep_prune(vdir, step, keep);
out:
    if (rc != 0 && tmp != NULL)
        (void)store_remove_tree(tmp);
    free(vdir);
    free(dst);
    free(tmp);
    free(in);
    return rc;
}

void manifest_prune(const char *state_dir, uint64_t step)
{
    if (step < MANIFEST_KEEP)
        return;
    for (int sig = 1; sig >= 0; sig--) {
        char *p = store_path_manifest(state_dir, step - MANIFEST_KEEP, sig);
        if (p != NULL)
            (void)unlink(p);    /* gone already, or never signed: nothing to do */
        free(p);
    }
}
