/* The configuration reads a transport's options through the transport's own table (hub.h's
 * hub_options): its defaults, its bounds (refused with the option's name, as a flag or FILE:LINE),
 * the environment's fallbacks of --hub's transport only, a key two transports share, and --help and
 * --check-config listing them.  Runs config_load as main() does, stdout and stderr captured. */
#include "test.h"

#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "config.h"

/* What config_load printed, and what it returned. */
typedef struct run {
    int rc;
    char out[16384], err[4096];
    config c;
} run;

static void slurp(int fd, char *buf, size_t size)
{
    ssize_t n;
    size_t len = 0;

    lseek(fd, 0, SEEK_SET);
    while (len + 1 < size && (n = read(fd, buf + len, size - 1 - len)) > 0)
        len += (size_t)n;
    buf[len] = '\0';
}

/* config_load on "dilocod --state-root <test dir> --listen none" + the NULL-terminated flags, then
 * config_print when it would run; the config is freed after. */
static void load(run *r, const char *first, ...)
{
    const char *argv[32] = {"dilocod", "--state-root", test_dir(), "--listen", "none"};
    int argc = 5, out_fd, err_fd, saved_out = dup(1), saved_err = dup(2);
    va_list ap;
    char out_path[4096], err_path[4096];

    va_start(ap, first);
    for (const char *a = first; a != NULL && argc < 31; a = va_arg(ap, const char *))
        argv[argc++] = a;
    va_end(ap);
    snprintf(out_path, sizeof(out_path), "%s", test_path("stdout"));
    snprintf(err_path, sizeof(err_path), "%s", test_path("stderr"));
    out_fd = open(out_path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    err_fd = open(err_path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(out_fd >= 0 && err_fd >= 0 && saved_out >= 0 && saved_err >= 0);
    fflush(stdout);
    fflush(stderr);
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    r->rc = config_load(&r->c, argc, (char **)argv);
    if (r->rc == 0)
        config_print(&r->c, stdout);
    fflush(stdout);
    fflush(stderr);
    dup2(saved_out, 1);
    dup2(saved_err, 2);
    close(saved_out);
    close(saved_err);
    slurp(out_fd, r->out, sizeof(r->out));
    slurp(err_fd, r->err, sizeof(r->err));
    close(out_fd);
    close(err_fd);
}

static void clear_env(void)
{
    const char *vars[] = {"AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL",
                          "HF_ENDPOINT", "HF_TOKEN"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
        unsetenv(vars[i]);
}

#define CHECK_HAS(hay, needle)                                                                        \
    do {                                                                                              \
        if (strstr((hay), (needle)) == NULL) {                                                        \
            fprintf(stderr, "  %s:%d: \"%s\" not in:\n%s\n", __FILE__, __LINE__, (needle), (hay));    \
            test_fail();                                                                              \
        }                                                                                             \
    } while (0)

TEST(transport_options_defaults_from_the_table)
{
    static run r;

    clear_env();
    load(&r, "--expected-nodes", "2", "--hub", "none", NULL);
    CHECK_EQ(r.rc, 0);
    /* every transport's options are printed, with its table's defaults, whatever --hub is */
    CHECK_HAS(r.out, "\ns3_addressing = auto\n");
    CHECK_HAS(r.out, "\ns3_part_mib = 64\n");
    CHECK_HAS(r.out, "\ns3_claim_lease = 60\n");
    CHECK_HAS(r.out, "\n# s3_region: not set (s3:// only)\n");
    CHECK_HAS(r.out, "\n# hub_endpoint: not set (hf:// and s3:// only)\n");
    CHECK_HAS(r.out, "\n# s3_credentials_file: not set (s3:// keys from the environment)\n");
    CHECK_HAS(r.out, "\n# hub token: not set\n");
    CHECK(config_hub_options(&r.c) == NULL);
    config_free(&r.c);

    /* --hub's transport loads its own: the region's last fallback */
    load(&r, "--expected-nodes", "2", "--hub", "s3://bucket", NULL);
    CHECK_EQ(r.rc, 0);
    CHECK_HAS(r.out, "\ns3_region = us-east-1\n");
    CHECK(config_hub_options(&r.c) != NULL);
    config_free(&r.c);
}

TEST(transport_options_bounds_name_the_option)
{
    static run r;
    char conf[4096];
    FILE *f;

    clear_env();
    load(&r, "--expected-nodes", "2", "--hub", "s3://bucket", "--s3-part-mib", "4", NULL);
    CHECK_EQ(r.rc, 2);
    CHECK_HAS(r.err, "dilocod: --s3-part-mib: '4' is not an integer in [5, 5120]");
    config_free(&r.c);
    /* the bounds hold for another transport's option too (then unused) */
    load(&r, "--expected-nodes", "2", "--s3-claim-lease", "86401", NULL);
    CHECK_EQ(r.rc, 2);
    CHECK_HAS(r.err, "dilocod: --s3-claim-lease: '86401' is not an integer in [2, 86400]");
    config_free(&r.c);
    /* a file line is named by FILE:LINE and its key */
    snprintf(conf, sizeof(conf), "%s", test_path("d.conf"));
    CHECK((f = fopen(conf, "w")) != NULL);
    fputs("expected_nodes = 2\ns3_claim_lease = 1\n", f);
    fclose(f);
    load(&r, "--config", conf, NULL);
    CHECK_EQ(r.rc, 2);
    char want[4200];
    snprintf(want, sizeof(want), "dilocod: %s:2: s3_claim_lease: '1' is not an integer in [2, 86400]", conf);
    CHECK_HAS(r.err, want);
    config_free(&r.c);
    /* the transport's load() names the option it refuses, and the file line that set it */
    CHECK((f = fopen(conf, "w")) != NULL);
    fputs("expected_nodes = 2\nhub = s3://bucket\ns3_region = EU\n", f);
    fclose(f);
    load(&r, "--config", conf, NULL);
    CHECK_EQ(r.rc, 2);
    snprintf(want, sizeof(want), "dilocod: %s:3: s3_region: 'EU' is not a region ([a-z0-9-]{1,32})", conf);
    CHECK_HAS(r.err, want);
    config_free(&r.c);
    load(&r, "--expected-nodes", "2", "--hub", "hf://org/model", "--hub-endpoint", "ftp://x", NULL);
    CHECK_EQ(r.rc, 2);
    CHECK_HAS(r.err, "dilocod: --hub-endpoint: 'ftp://x' is not an http(s) URL");
    config_free(&r.c);
    /* a value another transport would refuse is not checked while it is not --hub's */
    load(&r, "--expected-nodes", "2", "--hub", "hf://org/model", "--s3-region", "EU", NULL);
    CHECK_EQ(r.rc, 0);
    CHECK_HAS(r.out, "\ns3_region = EU\n");
    config_free(&r.c);
}

TEST(transport_options_environment_fallbacks)
{
    static run r;
    const char *v = NULL;

    clear_env();
    setenv("AWS_DEFAULT_REGION", "eu-west-3", 1);
    setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8333", 1);
    setenv("HF_ENDPOINT", "http://hf.invalid", 1);
    load(&r, "--expected-nodes", "2", "--hub", "s3://bucket/p", NULL);
    CHECK_EQ(r.rc, 0);
    CHECK_HAS(r.out, "\ns3_region = eu-west-3\n");
    CHECK_HAS(r.out, "\nhub_endpoint = http://127.0.0.1:8333\n");
    CHECK_EQ(config_hub_value(&r.c, "hub_endpoint", &v), 1);
    CHECK(v != NULL && strcmp(v, "http://127.0.0.1:8333") == 0);
    CHECK_EQ(config_hub_value(&r.c, "hub_token_file", &v), 0);     /* not an option of s3:// */
    config_free(&r.c);
    /* the first variable wins over the second, a flag over both */
    setenv("AWS_REGION", "ap-south-1", 1);
    load(&r, "--expected-nodes", "2", "--hub", "s3://bucket/p", "--hub-endpoint", "https://s3.example", NULL);
    CHECK_EQ(r.rc, 0);
    CHECK_HAS(r.out, "\ns3_region = ap-south-1\n");
    CHECK_HAS(r.out, "\nhub_endpoint = https://s3.example\n");
    config_free(&r.c);
    /* only --hub's transport reads the environment: hf:// takes $HF_ENDPOINT and $HF_TOKEN */
    setenv("HF_TOKEN", "hf_secret_for_test", 1);
    load(&r, "--expected-nodes", "2", "--hub", "hf://org/model", NULL);
    CHECK_EQ(r.rc, 0);
    CHECK_HAS(r.out, "\nhub_endpoint = http://hf.invalid\n");
    CHECK_HAS(r.out, "\n# s3_region: not set (s3:// only)\n");
    CHECK_HAS(r.out, "\n# hub_token_file: not set (the token is from $HF_TOKEN)\n# hub token: set\n");
    CHECK(strstr(r.out, "hf_secret_for_test") == NULL);
    config_free(&r.c);
    /* file:// has no endpoint: no option of that name */
    load(&r, "--expected-nodes", "2", "--hub", "file:///nonexistent-dir/hub", NULL);
    CHECK_EQ(r.rc, 0);
    CHECK_EQ(config_hub_value(&r.c, "hub_endpoint", &v), 0);
    config_free(&r.c);
}

TEST(transport_options_in_help)
{
    static run r;
    const char *first, *again;

    load(&r, "--help", NULL);
    CHECK_EQ(r.rc, 1);
    /* a key two transports declare is listed once, both helps joined */
    CHECK_HAS(r.out, "  --hub-endpoint URL     server of hf:// (default $HF_ENDPOINT or https://huggingface.co) or "
                     "s3:// (default $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL or AWS)\n");
    first = strstr(r.out, "--hub-endpoint");
    again = first != NULL ? strstr(first + 1, "--hub-endpoint") : NULL;
    CHECK(first != NULL && again == NULL);
    CHECK_HAS(r.out, "  --s3-part-mib MIB      s3:// multipart upload above this size, in parts of this size\n");
    CHECK_HAS(r.out, "  --hub URL              file:///abs/dir | hf://ns/repo[@rev] | s3://bucket[/prefix] | none\n");
    config_free(&r.c);
}

/* --max-weight-ratio (weighted_mean's cap: README, "Robust aggregation"): 10 unless set, at least 1 and
 * finite, refused with the option's name as a flag and with FILE:LINE from a file, printed back. */
TEST(max_weight_ratio_default_bounds_and_print)
{
    static run r;
    char conf[4096], want[4200];
    FILE *f;

    clear_env();
    load(&r, "--expected-nodes", "3", NULL);
    CHECK_EQ(r.rc, 0);
    CHECK(r.c.max_weight_ratio == 10);
    CHECK_HAS(r.out, "\nmax_weight_ratio = 10\n");
    config_free(&r.c);
    load(&r, "--expected-nodes", "3", "--aggregate", "weighted_mean", "--max-weight-ratio", "1", NULL);
    CHECK_EQ(r.rc, 0);
    CHECK(r.c.max_weight_ratio == 1);
    CHECK_HAS(r.out, "\nmax_weight_ratio = 1\n");
    config_free(&r.c);
    const char *bad_values[] = {"0.999", "0", "-2", "nan", "inf", "1e400", "2x"};
    for (size_t i = 0; i < sizeof(bad_values) / sizeof(bad_values[0]); i++) {
        load(&r, "--expected-nodes", "3", "--max-weight-ratio", bad_values[i], NULL);
        CHECK_EQ(r.rc, 2);
        snprintf(want, sizeof(want), "dilocod: --max-weight-ratio: '%s' is not a number in [1, 1e+30]",
                 bad_values[i]);
        CHECK_HAS(r.err, want);
        config_free(&r.c);
    }
    snprintf(conf, sizeof(conf), "%s", test_path("w.conf"));
    CHECK((f = fopen(conf, "w")) != NULL);
    fputs("expected_nodes = 3\naggregate = weighted_mean\nmax_weight_ratio = 0.5\n", f);
    fclose(f);
    load(&r, "--config", conf, NULL);
    CHECK_EQ(r.rc, 2);
    snprintf(want, sizeof(want), "dilocod: %s:3: max_weight_ratio: '0.5' is not a number in [1, 1e+30]", conf);
    CHECK_HAS(r.err, want);
    config_free(&r.c);
}
