/* diloco push: a delta (one file or a set) checked as the server would, then streamed to dilocod with retries. */
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
#include "cli_delta.h"
#include "cli_body.h"
#include "cli_untrusted.h"
#include "delta.h"
#include "fsutil.h"
#include "safetensors.h"
#include "st_index.h"
#include "stepcount.h"
#include "strbuf.h"
#include "cmd_http.h"

/* ---- push -------------------------------------------------------------------------------------- */

/* Token for node from a token file (lines "node_id token", "*" for any node). */
static char *token_for(const char *path, const char *node)
{
    FILE *f = fopen(path, "r");
    char line[1024], *found = NULL;

    if (f == NULL) {
        fprintf(stderr, "diloco: cannot open token file %s: %s\n", path, strerror(errno));
        return NULL;
    }
    while (fgets(line, sizeof(line), f) != NULL) {
        char *save = NULL, *id = strtok_r(line, " \t\r\n", &save), *tok = strtok_r(NULL, " \t\r\n", &save);
        if (id == NULL || id[0] == '#' || tok == NULL)
            continue;
        if (strcmp(id, node) == 0 || (strcmp(id, "*") == 0 && found == NULL)) {
            free(found);
            if ((found = strdup(tok)) == NULL) {
                fclose(f);
                fprintf(stderr, "diloco: out of memory reading %s\n", path);
                return NULL;
            }
            if (strcmp(id, node) == 0)
                break;
        }
    }
    fclose(f);
    if (found == NULL)
        fprintf(stderr, "diloco: %s has no token for node %s\n", path, node);
    return found;
}

static const char push_help[] =
    "usage: diloco push --server URL [--token-file F] [--retries N] [--timeout S] DELTA\n"
    "  Uploads DELTA to PUT /nodes/<node_id>/delta_<local_step>.safetensors, node id and step read from\n"
    "  the file's metadata (checked first: a file the server would refuse is not sent).  Streams the\n"
    "  file; retries connection errors and 5xx answers with backoff (never a 4xx); prints the answer.\n"
    "  An async dilocod's answer naming the local steps to train next (X-Recommended-Local-Steps, DyLU)\n"
    "  is printed with them as \"recommended_local_steps\": N.\n"
    "  A sharded delta (DELTA = delta_<local_step>.safetensors.index.json, as huggingface_hub writes it)\n"
    "  is checked as a set, then each shard is PUT to /nodes/<node_id>/delta_<n>-0000i-of-0000N.safetensors\n"
    "  and the index last to /nodes/<node_id>/delta_<n>.safetensors.index.json.\n"
    "  --server defaults to $DILOCO_SERVER; the token to $DILOCO_TOKEN when no token file is given.\n"
    "  exit: 0 accepted, 1 refused by the server or an invalid file, 2 usage, 3 I/O, 4 network/server\n";

/* Prints the server's answer to an upload in its shown form (cli_untrusted.h) on one line: the answer's
 * own final newline ends it, any other newline in it is a server's byte like the rest, shown escaped
 * (a line of its own could pass for ours).  When it carried X-Recommended-Local-Steps (an async
 * dilocod's DyLU: the local steps its next phase should train), a JSON object answer gets it as one more
 * member, "recommended_local_steps": N, spliced before its closing brace (the server's bytes otherwise). */
static void print_upload_answer(const response *r)
{
    const char *b = r->body.p ? r->body.p : "";
    size_t n = r->body.len;

    if (n > 0 && b[n - 1] == '\n')
        n--;
    if (r->recommended != 0) {
        cJSON *j = cJSON_ParseWithLength(b, n);
        size_t close = n;
        while (close > 0 && b[close - 1] != '}')
            close--;
        int object = cJSON_IsObject(j) && close > 0, members = object && j->child != NULL;
        cJSON_Delete(j);
        if (object) {
            cli_print_untrusted(stdout, b, close - 1);
            printf("%s\"recommended_local_steps\":%" PRIu64 "}", members ? "," : "", r->recommended);
            cli_print_untrusted(stdout, b + close, n - close);
            putchar('\n');
            return;
        }
        cli_print_untrusted(stdout, b, n);
        printf("%srecommended_local_steps=%" PRIu64 "\n", n > 0 ? "\n" : "", r->recommended);
        return;
    }
    cli_print_untrusted(stdout, b, n);
    if (r->body.len > 0)
        putchar('\n');
}

/* PUTs the file at path (size bytes) to upath, retrying connection errors and 5xx.  Prints the
 * server's answer.  Returns an exit code. */
static int put_file(const client_opts *o, const char *upath, const char *path, uint64_t size)
{
    char *url = cli_url_of(o, upath);
    int rc = EXIT_NETWORK;

    if (url == NULL)
        return EXIT_IO;
    for (int attempt = 0;; attempt++) {
        response r = {.cap = MAX_ANSWER};
        struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/octet-stream");
        FILE *in = fopen(path, "rb");
        if (in == NULL) {
            fprintf(stderr, "diloco: cannot open %s: %s\n", path, strerror(errno));
            curl_slist_free_all(h);
            rc = EXIT_IO;
            break;
        }
        CURL *e = cli_easy(o, url, &r, &h);
        CURLcode cc = CURLE_OUT_OF_MEMORY;
        if (e != NULL) {
            curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
            curl_easy_setopt(e, CURLOPT_READDATA, in);
            curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, (curl_off_t)size);
            cc = curl_easy_perform(e);
            curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &r.status);
        }
        curl_easy_cleanup(e);
        curl_slist_free_all(h);
        fclose(in);
        if (r.refused) {
            fprintf(stderr, "diloco: PUT %s: %s\n", url, r.why);
            free(r.body.p);
            rc = EXIT_INVALID;
            break;
        }
        if (cc == CURLE_OK && r.status >= 200 && r.status < 300) {
            print_upload_answer(&r);
            free(r.body.p);
            rc = EXIT_OK;
            break;
        }
        if (cc == CURLE_OK && r.status >= 400 && r.status < 500) {
            print_upload_answer(&r);
            cli_print_server_error(url, &r);
            free(r.body.p);
            rc = EXIT_INVALID;
            break;
        }
        if (attempt >= o->retries) {
            if (cc != CURLE_OK)
                fprintf(stderr, "diloco: PUT %s: %s\n", url, curl_easy_strerror(cc));
            else
                cli_print_server_error(url, &r);
            free(r.body.p);
            rc = EXIT_NETWORK;
            break;
        }
        double wait = cli_backoff(attempt);
        char why[400];
        cli_describe_failure(cc, &r, why, sizeof(why));
        free(r.body.p);
        fprintf(stderr, "diloco: PUT %s: %s, retrying in %.1f s (%d of %d)\n", url, why, wait, attempt + 1, o->retries);
        cli_sleep_s(wait);
    }
    free(url);
    return rc;
}

/* Checks a delta (one file or a set) as the server will, against itself (the global lives on the
 * server): a compressed delta's scales are not model keys (cli_delta.h).  On success *set is open and
 * info filled. */
static int check_local_delta(const char *path, st_set **set, delta_info *info, dl_error *err)
{
    int rc = st_set_open(path, set, err);

    if (rc == 0)
        rc = cli_check_delta_alone(*set, NULL, 0, info, err);
    /* The delta was checked against itself, so the rules' message "expected F32 for a F64 weight"
     * would name the delta's own dtype as the global's: say what a delta may hold instead, and
     * leave the global's dtype to the server's answer. */
    if (rc != 0 && err->code == DL_E_DTYPE_MISMATCH && *set != NULL) {
        const st_tensor *t = st_set_find(*set, err->tensor, strlen(err->tensor), NULL);
        if (t != NULL)
            snprintf(err->message, sizeof(err->message),
                     "delta tensor has dtype %s; a delta tensor is F32, F16 or BF16 (C64 for a complex weight), "
                     "whatever the dtype of the global's weight",
                     st_dtype_name(t->dtype));
    }
    if (rc == 0 && (*set)->index != NULL) {
        /* the index names its shards by its base: the server's paths are delta_<local_step>-..., so
         * a set saved under another base would upload an index that names files it does not have */
        char want[40];
        snprintf(want, sizeof(want), "delta_%" PRIu64, info->local_step);
        if (strcmp((*set)->index->base, want) != 0)
            rc = dl_fail(err, DL_E_PATH_MISMATCH, NULL, 0,
                         "a sharded delta of local_step %" PRIu64 " is saved as %s" ST_INDEX_SUFFIX
                         " (filename_pattern=\"%s{suffix}.safetensors\"), not %s" ST_INDEX_SUFFIX,
                         info->local_step, want, want, (*set)->index->base);
    }
    if (rc != 0) {
        st_set_close(*set);
        *set = NULL;
    }
    return rc;
}

int cmd_push(int argc, char **argv)
{
    static const struct option opts[] = {{"server", required_argument, NULL, 's'},
                                         {"token-file", required_argument, NULL, 't'},
                                         {"retries", required_argument, NULL, 'r'},
                                         {"timeout", required_argument, NULL, 'T'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    client_opts o;
    const char *token_file = NULL, *path;
    char *token = NULL, upath[400];
    st_set *set = NULL;
    delta_info info;
    dl_error err;
    int c, rc = EXIT_NETWORK;

    cli_opts_defaults(&o);
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 's': o.server = optarg; break;
        case 't': token_file = optarg; break;
        case 'r': if (cli_parse_count(optarg, 100, &o.retries) != 0) return cli_bad_value("--retries", optarg, push_help); break;
        case 'T': if (cli_parse_seconds(optarg, &o.timeout) != 0) return cli_bad_value("--timeout", optarg, push_help); break;
        case 'h': fputs(push_help, stdout); return EXIT_OK;
        default: fputs(push_help, stderr); return EXIT_USAGE;
        }
    }
    if (o.server == NULL || optind != argc - 1 || o.retries < 0 || o.retries > 100) {
        cli_usage_missing(o.server == NULL, optind >= argc ? "DELTA (the delta file to upload)" : NULL,
                      argc - optind > 1 ? argv[optind + 1] : NULL);
        fputs(push_help, stderr);
        return EXIT_USAGE;
    }
    path = argv[optind];
    dl_error_clear(&err);
    /* the delta's own header (or index) names it: check it as the server will, before sending a byte */
    if (check_local_delta(path, &set, &info, &err) != 0)
        return cli_report(path, &err);
    if (token_file != NULL) {
        if ((token = token_for(token_file, info.node_id)) == NULL) {
            st_set_close(set);
            return EXIT_USAGE;
        }
        o.token = token;
    } else {
        o.token = getenv("DILOCO_TOKEN");
    }
    if (set->index == NULL) {
        snprintf(upath, sizeof(upath), "/nodes/%s/delta_%" PRIu64 ".safetensors", info.node_id, info.local_step);
        rc = put_file(&o, upath, path, set->files[0]->file_size);
    } else {
        /* the shards first, the index last: the set is complete on the server when its index is in */
        rc = EXIT_OK;
        for (size_t i = 0; i < set->nfiles && rc == EXIT_OK; i++) {
            char name[ST_INDEX_BASE_MAX + 40];
            st_index_shard_name(set->index->base, (uint32_t)i, (uint32_t)set->nfiles, name, sizeof(name));
            snprintf(upath, sizeof(upath), "/nodes/%s/%s", info.node_id, name);
            rc = put_file(&o, upath, set->files[i]->path, set->files[i]->file_size);
        }
        if (rc == EXIT_OK) {
            struct stat sb;
            snprintf(upath, sizeof(upath), "/nodes/%s/%s" ST_INDEX_SUFFIX, info.node_id, set->index->base);
            if (stat(path, &sb) != 0) {
                fprintf(stderr, "diloco: cannot stat %s: %s\n", path, strerror(errno));
                rc = EXIT_IO;
            } else {
                rc = put_file(&o, upath, path, (uint64_t)sb.st_size);
            }
        }
    }
    st_set_close(set);
    free(token);
    return rc;
}
