/* diloco pull: the global model (one file or a set) downloaded from dilocod, If-None-Match on its ETag. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <strings.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cJSON.h>
#include <curl/curl.h>

#include "cli.h"
#include "cli_body.h"
#include "cli_untrusted.h"
#include "delta.h"
#include "fsutil.h"
#include "safetensors.h"
#include "st_index.h"
#include "stepcount.h"
#include "strbuf.h"
#include "cmd_http.h"

/* ---- pull -------------------------------------------------------------------------------------- */

static char *join(const char *dir, const char *name)
{
    char *p = NULL;
    if (asprintf(&p, "%s/%s", dir, name) < 0)
        return NULL;
    return p;
}

/* Removes from dir what another layout of "latest" left (the single file, or shards of another
 * count), after the new layout is in place. */
static void remove_other_layouts(const char *dir, uint32_t nshards)
{
    DIR *d = opendir(dir);
    struct dirent *de;

    if (d == NULL)
        return;
    while ((de = readdir(d)) != NULL) {
        char base[ST_INDEX_BASE_MAX + 1];
        uint32_t i, n;
        st_name_kind k = st_index_classify(de->d_name, strlen(de->d_name), base, &i, &n);
        if (strcmp(base, "latest") != 0 || k == ST_NAME_OTHER)
            continue;
        int stale = nshards == 1 ? (k == ST_NAME_INDEX || k == ST_NAME_SHARD)
                                 : (k == ST_NAME_SINGLE || (k == ST_NAME_SHARD && n != nshards));
        if (stale && unlinkat(dirfd(d), de->d_name, 0) != 0 && errno != ENOENT)
            fprintf(stderr, "diloco: cannot remove %s/%s: %s\n", dir, de->d_name, strerror(errno));
    }
    closedir(d);
}

/* A sharded global: the index (already in idx) names the shards; each is downloaded to a temporary
 * file, the set is checked as a whole, then the shards are renamed into place, the index written
 * last (atomically), and the step file after it: the same layout and order as the server's. */
static int pull_sharded(const client_opts *o, const char *dir, const response *idx, const char *stepfile,
                        const char *etagfile)
{
    st_index *ix = NULL;
    st_set *set = NULL;
    st_file **files = NULL;
    char **tmps = NULL, *index_path = join(dir, "latest" ST_INDEX_SUFFIX);
    response s = {.cap = MAX_ANSWER};
    uint32_t n = 0;
    uint64_t step;
    dl_error err;
    int rc;

    dl_error_clear(&err);
    if (index_path == NULL)
        return EXIT_IO;
    if (st_index_parse(idx->body.p ? idx->body.p : "", idx->body.len, "latest", &ix, &err) != 0) {
        rc = cli_report("the server's global/latest" ST_INDEX_SUFFIX, &err);
        goto out;
    }
    n = ix->nshards;
    files = calloc(n, sizeof(*files));
    tmps = calloc(n, sizeof(*tmps));
    if (files == NULL || tmps == NULL) {
        rc = EXIT_IO;
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) {
        char name[ST_INDEX_BASE_MAX + 40], rpath[ST_INDEX_BASE_MAX + 48], *final = NULL;
        cli_body guard = {0};
        response r = {.cap = MAX_ANSWER, .guard = &guard};
        FILE *sink = NULL;
        int fd = -1;
        st_index_shard_name("latest", i, n, name, sizeof(name));
        snprintf(rpath, sizeof(rpath), "/global/%s", name);
        if ((final = join(dir, name)) == NULL || fsu_tmp_create(final, &tmps[i], &fd, &err) != 0 ||
            (sink = fdopen(fd, "wb")) == NULL) {
            if (err.code == DL_OK)
                dl_fail_errno(&err, errno, "cannot write to %s", dir);
            if (fd >= 0 && sink == NULL)
                close(fd);
            free(final);
            rc = cli_report(dir, &err);
            goto out;
        }
        free(final);
        rc = cli_get(o, rpath, &r, NULL, sink);
        if (rc == 0 && r.status != 200) {
            cli_print_server_error(rpath, &r);
            rc = EXIT_INVALID;
        }
        if (rc == 0 && (fflush(sink) != 0 || fsync(fileno(sink)) != 0)) {
            dl_fail_errno(&err, errno, "writing %s", tmps[i]);
            rc = cli_report(tmps[i], &err);
        }
        fclose(sink);
        free(r.body.p);
        cli_body_reset(&guard);
        if (rc != 0)
            goto out;
        if (st_open(tmps[i], &files[i], &err) != 0) {
            rc = cli_report(rpath, &err);
            goto out;
        }
    }
    /* assemble owns the index and the files from here, whatever it answers */
    rc = st_set_assemble(index_path, ix, files, &set, &err);
    ix = NULL;
    files = NULL;
    if (rc != 0) {
        rc = cli_report("downloaded global", &err);
        goto out;
    }
    if ((rc = cli_get(o, "/global/step_count.json", &s, NULL, NULL)) != 0)
        goto out;
    if (s.status != 200 || stepcount_parse(s.body.p ? s.body.p : "", s.body.len, &step, NULL, NULL, &err) != 0) {
        fprintf(stderr, "diloco: the server's step_count.json is missing or invalid (HTTP %ld)\n", s.status);
        rc = EXIT_INVALID;
        goto out;
    }
    if (idx->has_outer_step && step != idx->outer_step) {
        fprintf(stderr, "diloco: the server moved from step %" PRIu64 " to %" PRIu64 " during the pull; retry\n",
                idx->outer_step, step);
        rc = EXIT_NETWORK;
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) {
        char name[ST_INDEX_BASE_MAX + 40], *final;
        st_index_shard_name("latest", i, n, name, sizeof(name));
        if ((final = join(dir, name)) == NULL || rename(tmps[i], final) != 0) {
            dl_fail_errno(&err, errno, "replacing %s/%s", dir, name);
            free(final);
            rc = cli_report(dir, &err);
            goto out;
        }
        free(final);
        free(tmps[i]);
        tmps[i] = NULL;
    }
    if (fsu_fsync_parent(index_path, &err) != 0 ||
        fsu_write_atomic(index_path, idx->body.p, idx->body.len, &err) != 0 ||
        fsu_write_atomic(stepfile, s.body.p, s.body.len, &err) != 0 ||
        fsu_write_atomic(etagfile, idx->etag, strlen(idx->etag), &err) != 0) {
        rc = cli_report(dir, &err);
        goto out;
    }
    remove_other_layouts(dir, n);
    printf("step %" PRIu64 " downloaded (%u shards)\n", step, n);
    rc = EXIT_OK;
out:
    for (uint32_t i = 0; tmps != NULL && i < n; i++) {
        if (tmps[i] != NULL)
            unlink(tmps[i]);
        free(tmps[i]);
    }
    free(tmps);
    for (uint32_t i = 0; files != NULL && i < n; i++)
        st_close(files[i]);
    free(files);
    st_index_free(ix);
    st_set_close(set);
    free(index_path);
    free(s.body.p);
    return rc;
}

static const char pull_help[] =
    "usage: diloco pull --server URL -o DIR [--retries N] [--timeout S]\n"
    "  Downloads global/latest.safetensors and global/step_count.json into DIR when they changed\n"
    "  (If-None-Match with the ETag kept in DIR/.latest.etag), verifies the model, and replaces both\n"
    "  files atomically (the model first).  Prints the step.  exit: 0 ok, 1 the server sent an invalid\n"
    "  file or refused, 2 usage, 3 I/O, 4 network/server\n"
    "  A sharded global (no global/latest.safetensors, a global/latest.safetensors.index.json) is\n"
    "  written in the same layout: DIR/latest-0000i-of-0000N.safetensors, checked as one set, then\n"
    "  DIR/latest.safetensors.index.json, then DIR/step_count.json.\n";

int cmd_pull(int argc, char **argv)
{
    static const struct option opts[] = {{"server", required_argument, NULL, 's'},
                                         {"output", required_argument, NULL, 'o'},
                                         {"retries", required_argument, NULL, 'r'},
                                         {"timeout", required_argument, NULL, 'T'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    client_opts o;
    const char *dir = NULL;
    char *model = NULL, *stepfile = NULL, *etagfile = NULL, *tmp = NULL;
    char etag[128] = "";
    cli_body guard = {0};
    response r = {.cap = MAX_ANSWER, .guard = &guard}, s = {.cap = MAX_ANSWER};
    dl_error err;
    int c, rc, fd = -1;
    FILE *sink = NULL;

    cli_opts_defaults(&o);
    while ((c = getopt_long(argc, argv, "ho:", opts, NULL)) != -1) {
        switch (c) {
        case 's': o.server = optarg; break;
        case 'o': dir = optarg; break;
        case 'r': if (cli_parse_count(optarg, 100, &o.retries) != 0) return cli_bad_value("--retries", optarg, pull_help); break;
        case 'T': if (cli_parse_seconds(optarg, &o.timeout) != 0) return cli_bad_value("--timeout", optarg, pull_help); break;
        case 'h': fputs(pull_help, stdout); return EXIT_OK;
        default: fputs(pull_help, stderr); return EXIT_USAGE;
        }
    }
    if (o.server == NULL || dir == NULL || optind != argc) {
        cli_usage_missing(o.server == NULL, dir == NULL ? "-o DIR (the directory to download the model into)" : NULL,
                      optind < argc ? argv[optind] : NULL);
        fputs(pull_help, stderr);
        return EXIT_USAGE;
    }
    dl_error_clear(&err);
    model = join(dir, "latest.safetensors");
    stepfile = join(dir, "step_count.json");
    etagfile = join(dir, ".latest.etag");
    if (!model || !stepfile || !etagfile || fsu_mkdirs(dir, &err) != 0) {
        rc = cli_report(dir, &err);
        goto out;
    }
    char *index_file = join(dir, "latest" ST_INDEX_SUFFIX);
    int have_model = access(model, R_OK) == 0 || (index_file != NULL && access(index_file, R_OK) == 0);
    free(index_file);
    if (have_model) {
        FILE *ef = fopen(etagfile, "r");
        if (ef != NULL) {
            if (fgets(etag, sizeof(etag), ef) == NULL)
                etag[0] = '\0';
            etag[strcspn(etag, "\r\n")] = '\0';
            fclose(ef);
        }
    }
    if (fsu_tmp_create(model, &tmp, &fd, &err) != 0 || (sink = fdopen(fd, "wb")) == NULL) {
        if (err.code == DL_OK)
            dl_fail_errno(&err, errno, "cannot write to %s", tmp ? tmp : dir);
        rc = cli_report(model, &err);
        goto out;
    }
    fd = -1;
    if ((rc = cli_get(&o, "/global/latest.safetensors", &r, etag, sink)) != 0)
        goto out;
    if (r.status == 304) {
        printf("step %" PRIu64 " (unchanged)\n", r.outer_step);
        rc = EXIT_OK;
        goto out;
    }
    if (r.status == 404) {
        /* no single file: a global past the shard size is published as an index and its shards */
        response ix = {.cap = ST_INDEX_MAX_BYTES};
        if ((rc = cli_get(&o, "/global/latest" ST_INDEX_SUFFIX, &ix, etag, NULL)) == 0) {
            if (ix.status == 304) {
                printf("step %" PRIu64 " (unchanged)\n", ix.outer_step);
                rc = EXIT_OK;
            } else if (ix.status == 200) {
                rc = pull_sharded(&o, dir, &ix, stepfile, etagfile);
            } else {
                cli_print_server_error("GET /global/latest.safetensors", &r);
                rc = EXIT_INVALID;
            }
        }
        free(ix.body.p);
        goto out;
    }
    if (r.status != 200) {
        cli_print_server_error("GET /global/latest.safetensors", &r);
        rc = EXIT_INVALID;
        goto out;
    }
    if (fflush(sink) != 0 || fsync(fileno(sink)) != 0) {
        dl_fail_errno(&err, errno, "writing %s", tmp);
        rc = cli_report(tmp, &err);
        goto out;
    }
    {
        st_file *check;
        if (st_open(tmp, &check, &err) != 0) {
            rc = cli_report("downloaded global", &err);
            goto out;
        }
        st_close(check);
    }
    if ((rc = cli_get(&o, "/global/step_count.json", &s, NULL, NULL)) != 0)
        goto out;
    uint64_t step;
    if (s.status != 200 || stepcount_parse(s.body.p ? s.body.p : "", s.body.len, &step, NULL, NULL, &err) != 0) {
        fprintf(stderr, "diloco: the server's step_count.json is missing or invalid (HTTP %ld)\n", s.status);
        rc = EXIT_INVALID;
        goto out;
    }
    if (r.has_outer_step && step != r.outer_step) {
        /* a commit happened between the two requests: the next pull fetches the newer pair */
        fprintf(stderr, "diloco: the server moved from step %" PRIu64 " to %" PRIu64 " during the pull; retry\n",
                r.outer_step, step);
        rc = EXIT_NETWORK;
        goto out;
    }
    fclose(sink);
    sink = NULL;
    if (rename(tmp, model) != 0 || fsu_fsync_parent(model, &err) != 0 ||
        fsu_write_atomic(stepfile, s.body.p, s.body.len, &err) != 0 ||
        fsu_write_atomic(etagfile, r.etag, strlen(r.etag), &err) != 0) {
        if (err.code == DL_OK)
            dl_fail_errno(&err, errno, "replacing %s", model);
        rc = cli_report(dir, &err);
        goto out;
    }
    free(tmp);
    tmp = NULL;
    remove_other_layouts(dir, 1);
    printf("step %" PRIu64 " downloaded\n", step);
    rc = EXIT_OK;
out:
    if (sink != NULL)
        fclose(sink);
    if (fd >= 0)
        close(fd);
    if (tmp != NULL) {
        unlink(tmp);
        free(tmp);
    }
    free(model);
    free(stepfile);
    free(etagfile);
    free(r.body.p);
    free(s.body.p);
    cli_body_reset(&guard);
    return rc;
}
