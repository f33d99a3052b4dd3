/* diloco keygen and verify-round: the keys of verifiable rounds (common/sign.h) and a signed step
 * recomputed with libdiloco's own pass (common/outer.h). */
#include <errno.h>
#include <ftw.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cJSON.h>

#include "blockhash.h"
#include "cli.h"
#include "cmd_http.h"
#include "delta.h"
#include "fsutil.h"
#include "outer.h"
#include "sign.h"
#include "st_index.h"

static double cli_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static const char keygen_help[] =
    "usage: diloco keygen -o FILE   (or --output FILE)\n"
    "       diloco keygen --fingerprint KEY\n"
    "\n"
    "Writes a new Ed25519 signing key for dilocod (its signing_key option): FILE (PEM PKCS#8, mode 0600) and\n"
    "FILE.pub (PEM SubjectPublicKeyInfo, for workers and verifiers).  Neither may exist.  Prints the\n"
    "key's fingerprint: the sha256 of its 32 raw public-key bytes, in hex, as signed records name it.\n"
    "--fingerprint KEY prints the fingerprint of a public (or private) key file.\n";

int cmd_keygen(int argc, char **argv)
{
    static const struct option opts[] = {{"output", required_argument, NULL, 'o'},
                                         {"fingerprint", required_argument, NULL, 'f'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *out = NULL, *show = NULL;
    char fp[SIGN_FINGERPRINT_HEX];
    dl_error err;
    int c;

    while ((c = getopt_long(argc, argv, "o:h", opts, NULL)) != -1) {
        if (c == 'o') out = optarg;
        else if (c == 'f') show = optarg;
        else if (c == 'h') {
            fputs(keygen_help, stdout);
            return EXIT_OK;
        } else {
            fputs(keygen_help, stderr);
            return EXIT_USAGE;
        }
    }
    if ((out == NULL) == (show == NULL) || optind != argc) {
        fprintf(stderr, "diloco: keygen needs either -o FILE or --fingerprint KEY\n%s", keygen_help);
        return EXIT_USAGE;
    }
    dl_error_clear(&err);
    if (show != NULL) {
        sign_key k;
        if (sign_pub_load(&k, show, &err) != 0)
            return err.code == DL_E_INVALID_ARGUMENT ? (cli_report(show, &err), EXIT_INVALID) : cli_report(show, &err);
        printf("%s  %s\n", k.fingerprint, show);
        sign_key_free(&k);
        return EXIT_OK;
    }
    if (sign_keygen(out, fp, &err) != 0)
        return cli_report(out, &err);
    printf("%s  %s.pub\n", fp, out);
    return EXIT_OK;
}

/* ---- diloco verify-round: a signed step recomputed with libdiloco's own pass ------------------------ */

static const char verify_round_help[] =
    "usage: diloco verify-round --manifest M --signature SIG --public-key PUB --previous-global G\n"
    "                           [--previous-momentum MOM] --inputs DIR [--threads N]\n"
    "\n"
    "Checks a step's signed record (global/rounds/<s>.json and its .json.sig) and recomputes the step:\n"
    "the signature under PUB; the previous global and momentum against the record's base; every\n"
    "aggregated input (DIR/nodes/<id>/delta_<n>.safetensors, the record's paths) against its block hash,\n"
    "its metadata against the record and its verdict against the rule (the screens' verdicts are taken\n"
    "from the record, not recomputed); then the step with libdiloco's own pass, and every output's block\n"
    "hash against the record.  Exit 0 only when all of that holds, else 1 naming the first difference\n"
    "(the signature, the previous global or momentum, an input by node id, an output).  Synchronous steps\n"
    "and bootstraps (--previous-global is then the step's own global); async updates are not verified yet.\n"
    "--previous-momentum may be left out only where the record's base has none (momentum 0, a first step).\n"
    "\n"
    "   or: diloco verify-round --server URL --step S --public-key PUB [--threads N]\n"
    "fetches all of it from dilocod (its signing_key and verify_keep): /global/rounds/S.json and .sig,\n"
    "/rounds/S-1/global.safetensors and momentum.safetensors, /rounds/S/inputs/<node_id>.safetensors.\n"
    "--chain FROM..TO (instead of --step) verifies every step from FROM to TO that way, and that each\n"
    "record's previous is the block hash of the record before it.\n";

/* Reads a whole file of at most cap bytes (the record, its signature): malloc'd, NUL-terminated. */
static int read_capped(const char *path, size_t cap, char **out, size_t *len, dl_error *err)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    size_t n;

    if (f == NULL)
        return dl_fail_errno(err, errno, "cannot open %s", path);
    if ((buf = malloc(cap + 2)) == NULL) {
        fclose(f);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    n = fread(buf, 1, cap + 1, f);
    int bad = ferror(f);
    fclose(f);
    if (bad || n > cap) {
        free(buf);
        return bad ? dl_fail_errno(err, EIO, "cannot read %s", path)
                   : dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s is over %zu bytes", path, cap);
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return 0;
}

static int hash_hex(const char *path, char hex[65], dl_error *err)
{
    unsigned char d[BLOCKHASH_SIZE];
    int rc = blockhash_path(path, d, err);
    if (rc == 0)
        blockhash_hex(d, hex);
    return rc;
}

/* A record member that must be a block hash (64 lowercase hex digits), or NULL. */
static const char *hash_member(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (cJSON_IsObject(v))                      /* outputs.<name> is {"path", "block_hash", "bytes"} */
        v = cJSON_GetObjectItemCaseSensitive(v, "block_hash");
    if (!cJSON_IsString(v) || strlen(v->valuestring) != 64 || strspn(v->valuestring, "0123456789abcdef") != 64)
        return NULL;
    return v->valuestring;
}

/* "the first difference": printed as `diloco: verify-round: <what>: <why>` and exit 1. */
static int differs(const char *what, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int differs(const char *what, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "diloco: verify-round: %s: ", what);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return EXIT_INVALID;
}

typedef struct vr_opts {
    const char *manifest, *signature, *public_key, *previous_global, *previous_momentum, *inputs;
    unsigned threads;
    const char *server, *step;  /* --server URL --step S: the rest fetched into a temporary directory */
    const char *chain;          /* --server URL --chain FROM..TO */
} vr_opts;

static void *run_thread(void *arg)
{
    (void)outer_run(arg);       /* the pass's own error is in p->rc / p->err */
    return NULL;
}

/* Runs the pass on o->threads threads (one is the caller's): the items are the same whatever the
 * count, so the same bytes (server/README "The data path"). */
static int run_pass(outer_pass *p, unsigned threads, dl_error *err)
{
    pthread_t th[64];
    unsigned started = 0;
    int rc;

    if ((rc = outer_prepare(p, err)) != 0)
        return rc;
    for (unsigned i = 1; i < threads && i < 64; i++)
        if (pthread_create(&th[started], NULL, run_thread, p) == 0)
            started++;
    rc = outer_run(p);
    for (unsigned i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    if (rc == 0)
        rc = p->rc;
    if (rc != 0) {
        *err = p->err;
        outer_abort(p);
    }
    int frc = outer_finish(p, rc == 0 ? err : NULL);
    return rc != 0 ? rc : frc;
}

/* The record's aggregated inputs: hashed, checked as deltas of the previous global, in the pass's order. */
static int check_inputs(const vr_opts *o, const cJSON *inputs, const st_set *global, uint64_t base, int scaled,
                        char ***paths_out, float **scales_out, size_t *n_out)
{
    size_t cap = (size_t)cJSON_GetArraySize(inputs), n = 0;
    char **paths = calloc(cap ? cap : 1, sizeof(*paths));
    float *scales = calloc(cap ? cap : 1, sizeof(*scales));
    const cJSON *in;
    dl_error err;
    int rc = 0;

    if (paths == NULL || scales == NULL) {
        free(paths);
        free(scales);
        return cli_report("verify-round", &(dl_error){.code = DL_E_NO_MEMORY, .message = "out of memory"});
    }
    cJSON_ArrayForEach(in, inputs) {
        const cJSON *node = cJSON_GetObjectItemCaseSensitive(in, "node_id"), *path = cJSON_GetObjectItemCaseSensitive(in, "path");
        const cJSON *verdict = cJSON_GetObjectItemCaseSensitive(in, "verdict"), *scale = cJSON_GetObjectItemCaseSensitive(in, "scale");
        const cJSON *ls = cJSON_GetObjectItemCaseSensitive(in, "local_step"), *bs = cJSON_GetObjectItemCaseSensitive(in, "base_outer_step");
        const char *want = hash_member(in, "block_hash");
        char hex[65], id[DELTA_NODE_ID_MAX + 8];
        delta_path dp;
        st_set *delta = NULL;
        delta_info info;

        if (!cJSON_IsString(verdict) || strcmp(verdict->valuestring, "aggregated") != 0)
            continue;           /* quarantined or refused: the screens' verdicts are the record's */
        if (!cJSON_IsString(node) || !cJSON_IsString(path) || !cJSON_IsNumber(ls) || !cJSON_IsNumber(bs) || want == NULL ||
            delta_parse_any_path(path->valuestring, &dp, NULL) != 0 || dp.kind != DELTA_PATH_SINGLE ||
            strcmp(dp.node_id, node->valuestring) != 0 || (double)dp.local_step != ls->valuedouble) {
            rc = differs("record", "an aggregated input is not {node_id, path nodes/<id>/delta_<n>.safetensors, "
                         "local_step, base_outer_step, block_hash} (a set's shards are not verified yet)");
            break;
        }
        snprintf(id, sizeof(id), "input %s", dp.node_id);
        if ((scale != NULL) != scaled || (scale != NULL && !cJSON_IsNumber(scale))) {
            rc = differs(id, "%s", scaled ? "the rule weighs every input, and this one has no scale"
                                          : "a scale, but the record's rule weighs no input");
            break;
        }
        if (asprintf(&paths[n], "%s/%s", o->inputs, path->valuestring) < 0) {
            paths[n] = NULL;
            rc = differs(id, "out of memory");
            break;
        }
        scales[n] = scale != NULL ? (float)scale->valuedouble : 1.0f;
        dl_error_clear(&err);
        if (hash_hex(paths[n], hex, &err) != 0) {
            n++;
            rc = differs(id, "%s", err.message);
            break;
        }
        if (strcmp(hex, want) != 0) {
            rc = differs(id, "%s has block hash %s, the record names %s", paths[n], hex, want);
            n++;
            break;
        }
        /* hostile until checked: the delta rules against the previous global, and the record's facts */
        if (st_set_open(paths[n], &delta, &err) != 0 ||
            delta_validate_set(delta, global->by_name, global->ntensors, path->valuestring, &info, &err) != 0) {
            rc = differs(id, "%s: %s", dl_error_name(err.code), err.message);
            st_set_close(delta);
            n++;
            break;
        }
        st_set_close(delta);
        n++;
        if ((double)info.base_outer_step != bs->valuedouble || info.base_outer_step != base) {
            rc = differs(id, "based on step %" PRIu64 ", the record says %.0f and the step's base is %" PRIu64,
                         info.base_outer_step, bs->valuedouble, base);
            break;
        }
    }
    if (rc == 0 && n == 0)
        rc = differs("record", "no aggregated input");
    *paths_out = paths;
    *scales_out = scales;
    *n_out = n;
    return rc;
}

static int verify_round(const vr_opts *o)
{
    char *text = NULL, *sig = NULL, *tmpdir = NULL, *out_global = NULL, *out_momentum = NULL, **paths = NULL;
    char hex[65], step_text[24];
    size_t len = 0, slen = 0, n = 0;
    float *scales = NULL;
    sign_key pub = {0};
    cJSON *root = NULL;
    st_set *global = NULL;
    outer_pass p = {0};
    dl_error err;
    int rc;
    double t0 = cli_now();

    dl_error_clear(&err);
    if ((rc = read_capped(o->manifest, 4 << 20, &text, &len, &err)) != 0 ||
        (rc = read_capped(o->signature, SIGN_BYTES, &sig, &slen, &err)) != 0 || (rc = sign_pub_load(&pub, o->public_key, &err)) != 0) {
        rc = cli_report("verify-round", &err);
        goto out;
    }
    if (slen != SIGN_BYTES || !sign_verify(&pub, text, len, (const unsigned char *)sig)) {
        rc = differs("signature", "%s is not %s's signature of %s", o->signature, o->public_key, o->manifest);
        goto out;
    }
    root = cJSON_ParseWithLength(text, len);
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(root, "outer_step"), *origin = cJSON_GetObjectItemCaseSensitive(root, "origin");
    const cJSON *agg = cJSON_GetObjectItemCaseSensitive(root, "aggregator"), *cfg = cJSON_GetObjectItemCaseSensitive(root, "config");
    const cJSON *outputs = cJSON_GetObjectItemCaseSensitive(root, "outputs"), *inputs = cJSON_GetObjectItemCaseSensitive(root, "inputs");
    const cJSON *fpr = cJSON_GetObjectItemCaseSensitive(agg, "key_fingerprint");
    if (!cJSON_IsNumber(step) || step->valuedouble < 0 || step->valuedouble > 9007199254740991.0 ||
        !cJSON_IsString(origin) || !cJSON_IsObject(cfg) || !cJSON_IsObject(outputs) || !cJSON_IsArray(inputs) ||
        hash_member(outputs, "global") == NULL) {
        rc = differs("record", "%s is not a signed step record (outer_step, origin, config, inputs, outputs)", o->manifest);
        goto out;
    }
    if (!cJSON_IsString(fpr) || strcmp(fpr->valuestring, pub.fingerprint) != 0) {
        rc = differs("record", "it names key %s, not %s's %s", cJSON_IsString(fpr) ? fpr->valuestring : "(none)",
                     o->public_key, pub.fingerprint);
        goto out;
    }
    uint64_t s = (uint64_t)step->valuedouble;
    if (strcmp(origin->valuestring, "round") != 0) {
        /* a bootstrap or an adoption: nothing to recompute, its global is the input */
        if ((rc = hash_hex(o->previous_global, hex, &err)) != 0) {
            rc = cli_report(o->previous_global, &err);
            goto out;
        }
        if (strcmp(hex, hash_member(outputs, "global")) != 0) {
            rc = differs("output global", "%s has block hash %s, the record names %s", o->previous_global, hex,
                         hash_member(outputs, "global"));
            goto out;
        }
        printf("step %" PRIu64 " (%s) verified: its global is the one signed\n", s, origin->valuestring);
        goto out;
    }
    const cJSON *mode = cJSON_GetObjectItemCaseSensitive(cfg, "mode"), *opt = cJSON_GetObjectItemCaseSensitive(cfg, "optimizer");
    const cJSON *lr = cJSON_GetObjectItemCaseSensitive(cfg, "lr"), *mom = cJSON_GetObjectItemCaseSensitive(cfg, "momentum");
    const cJSON *rule = cJSON_GetObjectItemCaseSensitive(cfg, "aggregate"), *trim = cJSON_GetObjectItemCaseSensitive(cfg, "trim_k");
    const cJSON *base = cJSON_GetObjectItemCaseSensitive(root, "base");
    if (!cJSON_IsString(mode) || !cJSON_IsString(opt) || !cJSON_IsNumber(lr) || !cJSON_IsNumber(mom) ||
        !cJSON_IsString(rule) || s == 0) {
        rc = differs("record", "its config lacks mode, optimizer, lr, momentum or aggregate");
        goto out;
    }
    if (strcmp(mode->valuestring, "sync") != 0) {
        fprintf(stderr, "diloco: verify-round: step %" PRIu64 " is an async update: not verified yet\n", s);
        rc = EXIT_USAGE;
        goto out;
    }
    static const char *const rules[] = {"mean", "weighted_mean", "clipped_mean", "trimmed_mean", "median"};
    int r = -1;
    for (int i = 0; i < 5; i++)
        if (strcmp(rule->valuestring, rules[i]) == 0)
            r = i;
    if (r < 0 || (strcmp(opt->valuestring, "nesterov_sgd") != 0 && strcmp(opt->valuestring, "sgd") != 0) ||
        (r == OUTER_RULE_TRIMMED && (!cJSON_IsNumber(trim) || trim->valuedouble < 0 || trim->valuedouble > 1e6))) {
        rc = differs("record", "an optimizer or a rule this tool does not know (%s, %s)", opt->valuestring, rule->valuestring);
        goto out;
    }
    /* the previous global and momentum: the record's base, when it names one */
    const char *want_g = cJSON_IsObject(base) ? hash_member(base, "global") : NULL;
    const char *want_m = cJSON_IsObject(base) ? hash_member(base, "momentum") : NULL;
    if ((rc = hash_hex(o->previous_global, hex, &err)) != 0) {
        rc = cli_report(o->previous_global, &err);
        goto out;
    }
    if (want_g != NULL && strcmp(hex, want_g) != 0) {
        rc = differs("previous global", "%s has block hash %s, the record's base names %s", o->previous_global, hex, want_g);
        goto out;
    }
    if (want_m != NULL && o->previous_momentum == NULL) {
        rc = differs("previous momentum", "the record's base has a momentum (%s): give --previous-momentum", want_m);
        goto out;
    }
    if (o->previous_momentum != NULL) {
        if ((rc = hash_hex(o->previous_momentum, hex, &err)) != 0) {
            rc = cli_report(o->previous_momentum, &err);
            goto out;
        }
        if (cJSON_IsObject(base) && (want_m == NULL || strcmp(hex, want_m) != 0)) {
            rc = differs("previous momentum", "%s has block hash %s, the record's base names %s", o->previous_momentum,
                         hex, want_m != NULL ? want_m : "none");
            goto out;
        }
    }
    if (!cJSON_IsObject(base))
        fprintf(stderr, "diloco: verify-round: warning: the record names no base (the first signed step): the "
                        "previous global and momentum are taken as given\n");
    if (st_set_open(o->previous_global, &global, &err) != 0) {
        rc = cli_report(o->previous_global, &err);
        goto out;
    }
    if ((rc = check_inputs(o, inputs, global, s - 1, r == OUTER_RULE_WEIGHTED || r == OUTER_RULE_CLIPPED, &paths,
                           &scales, &n)) != 0)
        goto out;
    /* the step, with libdiloco's own pass, into a directory of its own */
    const char *td = getenv("TMPDIR");
    if (asprintf(&tmpdir, "%s/diloco-verify-XXXXXX", td != NULL && td[0] != '\0' ? td : "/tmp") < 0 ||
        mkdtemp(tmpdir) == NULL || asprintf(&out_global, "%s/global.safetensors", tmpdir) < 0 ||
        asprintf(&out_momentum, "%s/momentum.safetensors", tmpdir) < 0) {
        rc = differs("verify-round", "cannot make a temporary directory (TMPDIR): %s", strerror(errno));
        goto out;
    }
    snprintf(step_text, sizeof(step_text), "%" PRIu64, s);
    st_kv meta[2] = {{"optimizer", opt->valuestring}, {"outer_step", step_text}};
    p.global_path = o->previous_global;
    p.momentum_path = o->previous_momentum;
    p.delta_paths = (const char *const *)paths;
    p.ndeltas = n;
    p.delta_scale = r == OUTER_RULE_WEIGHTED || r == OUTER_RULE_CLIPPED ? scales : NULL;
    p.out_global_path = out_global;
    p.out_momentum_path = mom->valuedouble != 0 ? out_momentum : NULL;
    p.momentum_meta = meta;
    p.momentum_nmeta = 2;
    p.params.rule = (outer_rule)r;
    p.params.trim_k = r == OUTER_RULE_TRIMMED ? (unsigned)trim->valuedouble : 0;
    p.params.nesterov = strcmp(opt->valuestring, "nesterov_sgd") == 0;
    p.params.lr = (float)lr->valuedouble;
    p.params.momentum = (float)mom->valuedouble;
    p.budget_bytes = 16u << 20;
    p.defer_sync = 1;
    double tp = cli_now();
    if ((rc = run_pass(&p, o->threads, &err)) != 0) {
        rc = differs("recompute", "%s: %s", dl_error_name(err.code), err.message);
        goto out;
    }
    double pass_s = cli_now() - tp;
    /* every output the record names, in its order */
    const cJSON *out;
    int unchecked = 0;
    cJSON_ArrayForEach(out, outputs) {
        if (strcmp(out->string, "view") == 0 || strcmp(out->string, "update") == 0) {
            unchecked++;        /* --downlink's: rebuilding them needs the previous view, not kept yet */
            continue;
        }
        const char *file = strcmp(out->string, "global") == 0 ? out_global
                           : strcmp(out->string, "momentum") == 0 && p.out_momentum_path != NULL ? out_momentum : NULL;
        const char *want = hash_member(outputs, out->string);
        char what[96];
        snprintf(what, sizeof(what), "output %.80s", out->string);
        if (file == NULL || want == NULL) {
            rc = differs(what, "this step makes no such output");
            goto out;
        }
        if ((rc = hash_hex(file, hex, &err)) != 0) {
            rc = cli_report(file, &err);
            goto out;
        }
        if (strcmp(hex, want) != 0) {
            rc = differs(what, "recomputed, its block hash is %s; the record names %s", hex, want);
            goto out;
        }
    }
    if (p.out_momentum_path != NULL && hash_member(outputs, "momentum") == NULL) {
        rc = differs("output momentum", "the step makes one, and the record names none");
        goto out;
    }
    printf("step %" PRIu64 " verified: signature, %zu inputs, %d outputs (pass %.3f s, total %.3f s)\n", s, n,
           cJSON_GetArraySize(outputs) - unchecked, pass_s, cli_now() - t0);
    if (unchecked > 0)
        printf("step %" PRIu64 ": the downlink's view and update the record names are not recomputed (verify-round "
               "does not rebuild them yet)\n", s);
    rc = EXIT_OK;
out:
    outer_free(&p);
    if (out_global != NULL)
        unlink(out_global);
    if (out_momentum != NULL)
        unlink(out_momentum);
    if (tmpdir != NULL)
        rmdir(tmpdir);
    for (size_t i = 0; paths != NULL && i < n; i++)
        free(paths[i]);
    free(paths);
    free(scales);
    free(out_global);
    free(out_momentum);
    free(tmpdir);
    st_set_close(global);
    cJSON_Delete(root);
    free(text);
    free(sig);
    if (pub.pkey != NULL)
        sign_key_free(&pub);
    return rc;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

/* rm -r of the temporary directory this command made (links not followed: FTW_PHYS). */
static int rm_tree(const char *dir)
{
    return nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* GET path into file (a safetensors file: taken only up to its own size; a small one: cap bytes).
 * 0, 1 for a 404, or an exit code with the reason printed. */
static int fetch_to(const client_opts *co, const char *path, const char *file, int safetensors, size_t cap)
{
    cli_body guard = {0};
    response r = {.cap = MAX_ANSWER, .guard = safetensors ? &guard : NULL};
    FILE *sink = NULL;
    int rc;

    if (!safetensors) {
        r.cap = cap;
    } else if ((sink = fopen(file, "wbx")) == NULL) {
        fprintf(stderr, "diloco: verify-round: cannot write %s: %s\n", file, strerror(errno));
        return EXIT_IO;
    }
    rc = cli_get(co, path, &r, NULL, sink);
    if (rc == 0 && r.status == 404) {
        rc = 1;
    } else if (rc == 0 && r.status != 200) {
        cli_print_server_error(path, &r);
        rc = EXIT_INVALID;
    } else if (rc == 0 && !safetensors) {
        FILE *f = fopen(file, "wbx");
        if (f == NULL || fwrite(r.body.p != NULL ? r.body.p : "", 1, r.body.len, f) != r.body.len) {
            fprintf(stderr, "diloco: verify-round: cannot write %s: %s\n", file, strerror(errno));
            rc = EXIT_IO;
        }
        if (f != NULL && fclose(f) != 0 && rc == 0)
            rc = EXIT_IO;
    }
    if (sink != NULL && fclose(sink) != 0 && rc == 0)
        rc = EXIT_IO;
    free(r.body.p);
    cli_body_reset(&guard);
    return rc;
}

/* --server URL --step S: the record, its signature, the previous step's kept global and momentum and the
 * step's kept inputs fetched into a temporary directory, then verified as files. */
static int verify_from_server(vr_opts *o)
{
    client_opts co;
    char *dir = NULL, *m = NULL, *sig = NULL, *g = NULL, *mom = NULL, *in = NULL, path[160], *text = NULL;
    const char *td = getenv("TMPDIR");
    uint64_t s;
    size_t len;
    cJSON *root = NULL;
    dl_error err;
    int rc;

    cli_opts_defaults(&co);
    co.server = o->server;
    if (delta_parse_int(o->step, strlen(o->step), &s) != 0 || s == 0) {
        fprintf(stderr, "diloco: verify-round: --step %s: give a round's step (1 or more)\n%s", o->step, verify_round_help);
        return EXIT_USAGE;
    }
    if (asprintf(&dir, "%s/diloco-verify-XXXXXX", td != NULL && td[0] != '\0' ? td : "/tmp") < 0 || mkdtemp(dir) == NULL ||
        asprintf(&m, "%s/record.json", dir) < 0 || asprintf(&sig, "%s/record.json.sig", dir) < 0 ||
        asprintf(&g, "%s/previous-global.safetensors", dir) < 0 || asprintf(&mom, "%s/previous-momentum.safetensors", dir) < 0 ||
        asprintf(&in, "%s/inputs", dir) < 0) {
        fprintf(stderr, "diloco: verify-round: cannot make a temporary directory (TMPDIR): %s\n", strerror(errno));
        free(dir);
        return EXIT_IO;
    }
    snprintf(path, sizeof(path), "/global/rounds/%" PRIu64 ".json", s);
    if ((rc = fetch_to(&co, path, m, 0, 4 << 20)) == 1)
        fprintf(stderr, "diloco: verify-round: %s: the server has no record of step %" PRIu64 "\n", path, s);
    snprintf(path, sizeof(path), "/global/rounds/%" PRIu64 ".json.sig", s);
    if (rc == 0 && (rc = fetch_to(&co, path, sig, 0, SIGN_BYTES)) == 1)
        fprintf(stderr, "diloco: verify-round: %s: no signature\n", path);
    snprintf(path, sizeof(path), "/rounds/%" PRIu64 "/global.safetensors", s - 1);
    if (rc == 0 && (rc = fetch_to(&co, path, g, 1, 0)) == 1)
        fprintf(stderr, "diloco: verify-round: %s: step %" PRIu64 " is not kept (--verify-keep)\n", path, s - 1);
    snprintf(path, sizeof(path), "/rounds/%" PRIu64 "/momentum.safetensors", s - 1);
    int mrc = rc == 0 ? fetch_to(&co, path, mom, 1, 0) : 1;
    if (mrc > 1)
        rc = mrc;
    o->manifest = m;
    o->signature = sig;
    o->previous_global = g;
    o->previous_momentum = mrc == 0 ? mom : NULL;
    o->inputs = in;
    /* the record names the inputs: each one kept for the step, put at its path (hostile until verified:
     * only what the record names, under names the delta path rules allow) */
    dl_error_clear(&err);
    if (rc == 0 && read_capped(m, 4 << 20, &text, &len, &err) != 0)
        rc = cli_report(m, &err);
    root = rc == 0 ? cJSON_ParseWithLength(text, len) : NULL;
    const cJSON *inputs = cJSON_GetObjectItemCaseSensitive(root, "inputs"), *i;
    cJSON_ArrayForEach(i, inputs) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(i, "verdict"), *p = cJSON_GetObjectItemCaseSensitive(i, "path");
        delta_path dp;
        char *file = NULL, *ndir = NULL;
        if (rc != 0 || !cJSON_IsString(v) || strcmp(v->valuestring, "aggregated") != 0 || !cJSON_IsString(p) ||
            delta_parse_any_path(p->valuestring, &dp, NULL) != 0 || dp.kind != DELTA_PATH_SINGLE)
            continue;           /* verify_round names what is wrong with the record */
        snprintf(path, sizeof(path), "/rounds/%" PRIu64 "/inputs/%s.safetensors", s, dp.node_id);
        if (asprintf(&ndir, "%s/nodes/%s", in, dp.node_id) < 0 || asprintf(&file, "%s/%s", in, p->valuestring) < 0) {
            ndir = file = NULL;
            rc = EXIT_IO;
        } else if (fsu_mkdirs(ndir, &err) != 0) {
            rc = cli_report(ndir, &err);
        } else if ((rc = fetch_to(&co, path, file, 1, 0)) == 1) {
            fprintf(stderr, "diloco: verify-round: %s: the input of node %s is not kept (--verify-keep)\n", path,
                    dp.node_id);
        }
        free(ndir);
        free(file);
    }
    if (rc == 0)
        rc = verify_round(o);
    else if (rc == 1)
        rc = EXIT_INVALID;
    cJSON_Delete(root);
    free(text);
    if (rm_tree(dir) != 0)
        fprintf(stderr, "diloco: verify-round: could not remove %s\n", dir);
    free(dir);
    free(m);
    free(sig);
    free(g);
    free(mom);
    free(in);
    return rc;
}

/* --chain FROM..TO: each step verified from the server, and each record's previous checked against the
 * block hash of the record before it (the records themselves: their signatures verify_round checks). */
static int verify_chain(vr_opts *o)
{
    client_opts co;
    const char *dots = strstr(o->chain, "..");
    uint64_t from, to;
    char prev[65] = "", path[96], step[24];
    int rc = 0;

    cli_opts_defaults(&co);
    co.server = o->server;
    if (dots == NULL || delta_parse_int(o->chain, (size_t)(dots - o->chain), &from) != 0 ||
        delta_parse_int(dots + 2, strlen(dots + 2), &to) != 0 || from == 0 || to < from || to - from > 100000) {
        fprintf(stderr, "diloco: verify-round: --chain %s: give FROM..TO, round steps (1 or more), FROM <= TO\n%s",
                o->chain, verify_round_help);
        return EXIT_USAGE;
    }
    for (uint64_t s = from; s <= to && rc == 0; s++) {
        response r = {.cap = 4u << 20};
        unsigned char d[BLOCKHASH_SIZE];
        char here[65];
        dl_error err;
        snprintf(step, sizeof(step), "%" PRIu64, s);
        o->step = step;
        if ((rc = verify_from_server(o)) != 0)
            break;
        /* the record again for its link (verify_from_server checked its signature; a server that answers
         * differently now fails the link or the next step's) */
        snprintf(path, sizeof(path), "/global/rounds/%" PRIu64 ".json", s);
        if ((rc = cli_get(&co, path, &r, NULL, NULL)) == 0 && r.status != 200) {
            cli_print_server_error(path, &r);
            rc = EXIT_INVALID;
        }
        cJSON *root = rc == 0 ? cJSON_ParseWithLength(r.body.p != NULL ? r.body.p : "", r.body.len) : NULL;
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "previous");
        dl_error_clear(&err);
        if (rc == 0 && blockhash_bytes(r.body.p != NULL ? r.body.p : "", r.body.len, d, &err) != 0)
            rc = cli_report(path, &err);
        if (rc == 0) {
            blockhash_hex(d, here);
            if (prev[0] != '\0' && (!cJSON_IsString(p) || strcmp(p->valuestring, prev) != 0))
                rc = differs("chain", "the record of step %" PRIu64 " does not name step %" PRIu64 "'s record (%s) as "
                             "its previous", s, s - 1, prev);
            memcpy(prev, here, sizeof(prev));
        }
        cJSON_Delete(root);
        free(r.body.p);
    }
    if (rc == 0)
        printf("steps %" PRIu64 "..%" PRIu64 " verified, each record chained to the one before it\n", from, to);
    return rc;
}

int cmd_verify_round(int argc, char **argv)
{
    static const struct option opts[] = {{"manifest", required_argument, NULL, 'm'},
                                         {"signature", required_argument, NULL, 's'},
                                         {"public-key", required_argument, NULL, 'k'},
                                         {"previous-global", required_argument, NULL, 'g'},
                                         {"previous-momentum", required_argument, NULL, 'M'},
                                         {"inputs", required_argument, NULL, 'i'},
                                         {"threads", required_argument, NULL, 't'},
                                         {"server", required_argument, NULL, 'S'},
                                         {"step", required_argument, NULL, 'n'},
                                         {"chain", required_argument, NULL, 'c'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    vr_opts o = {.threads = 1};
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int c;

    o.threads = cpus > 0 && cpus < 64 ? (unsigned)cpus : 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': o.manifest = optarg; break;
        case 's': o.signature = optarg; break;
        case 'k': o.public_key = optarg; break;
        case 'g': o.previous_global = optarg; break;
        case 'M': o.previous_momentum = optarg; break;
        case 'i': o.inputs = optarg; break;
        case 'S': o.server = optarg; break;
        case 'n': o.step = optarg; break;
        case 'c': o.chain = optarg; break;
        case 't': {
            char *end;
            errno = 0;
            unsigned long v = strtoul(optarg, &end, 10);
            if (errno != 0 || end == optarg || *end != '\0' || v < 1 || v > 64) {
                fprintf(stderr, "diloco: --threads %s: give 1 to 64\n%s", optarg, verify_round_help);
                return EXIT_USAGE;
            }
            o.threads = (unsigned)v;
            break;
        }
        case 'h': fputs(verify_round_help, stdout); return EXIT_OK;
        default: fputs(verify_round_help, stderr); return EXIT_USAGE;
        }
    }
    if (o.server != NULL || o.step != NULL || o.chain != NULL) {
        if (o.server == NULL || (o.step == NULL) == (o.chain == NULL) || o.public_key == NULL || o.manifest != NULL ||
            o.signature != NULL || o.previous_global != NULL || o.previous_momentum != NULL || o.inputs != NULL ||
            optind != argc) {
            fprintf(stderr, "diloco: verify-round --server URL needs --step S or --chain FROM..TO, --public-key and no "
                            "file options\n%s", verify_round_help);
            return EXIT_USAGE;
        }
        return o.chain != NULL ? verify_chain(&o) : verify_from_server(&o);
    }
    if (o.manifest == NULL || o.signature == NULL || o.public_key == NULL || o.previous_global == NULL ||
        o.inputs == NULL || optind != argc) {
        fprintf(stderr, "diloco: verify-round needs --manifest, --signature, --public-key, --previous-global and "
                        "--inputs\n%s", verify_round_help);
        return EXIT_USAGE;
    }
    return verify_round(&o);
}
