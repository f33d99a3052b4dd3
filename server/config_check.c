/* config_check.c: the options checked together once every source is read (config_load): everything a start
 * would refuse, refused before anything is created; each refusal names the line or flag that set the option. */
#include "config.h"
#include "config_internal.h"
#include "auth.h"
#include "fsutil.h"
#include "hub.h"
#include "sign.h"
#include "st_index.h"
#include "store.h"

#include <errno.h>
#include <netdb.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* A file an option names is opened by its reader without O_NONBLOCK: a FIFO or a device there would
 * hold the start (or --check-config) forever, so only a regular file gets that far. */
static int check_regular_file(const config *c, const char *key, const char *path)
{
    dl_error err;

    dl_error_clear(&err);
    return fsu_check_regular_file(path, &err) != 0 ? config__bad_opt(c, key, "%s", err.message) : 0;
}

/* The options of --hub's transport: the environment's fallbacks, then its checks (hub.h). */
static int load_transport_options(config *c)
{
    size_t t = config__transport_of(c->hub);
    const hub_options *ho = t < hub_transport_count() ? hub_transport(t)->options : NULL;
    const char *key = "hub";
    dl_error err;

    if (ho == NULL || ho->load == NULL)
        return 0;
    dl_error_clear(&err);
    return ho->load(c->hub_opts[t], c->hub, &key, &err) != 0 ? config__bad_opt(c, key, "%s", err.message) : 0;
}

/* HOST:PORT, [v6]:PORT or none. */
static int parse_listen(config *c)
{
    const char *v = c->listen, *colon;
    char *end;
    long port;

    free(c->listen_host);
    c->listen_host = NULL;
    if (strcmp(v, "none") == 0)
        return 0;
    if (v[0] == '[') {
        const char *close = strchr(v, ']');
        if (close == NULL || close[1] != ':')
            return config__bad_opt(c, "listen", "'%s' is not HOST:PORT, [V6ADDR]:PORT or none", v);
        if ((c->listen_host = strndup(v + 1, (size_t)(close - v - 1))) == NULL)
            return config__bad_opt(c, "listen", "out of memory");
        colon = close + 1;
    } else {
        colon = strrchr(v, ':');
        if (colon == NULL || colon == v)
            return config__bad_opt(c, "listen", "'%s' is not HOST:PORT, [V6ADDR]:PORT or none", v);
        if ((c->listen_host = strndup(v, (size_t)(colon - v))) == NULL)
            return config__bad_opt(c, "listen", "out of memory");
    }
    errno = 0;
    port = strtol(colon + 1, &end, 10);
    if (colon[1] == '\0' || *end != '\0' || errno != 0 || port < 0 || port > 65535)
        return config__bad_opt(c, "listen", "'%s': the port must be 0..65535", v);
    c->listen_port = (int)port;
    return 0;
}

/* The address must resolve as the HTTP engine resolves it and belong to this machine.  Bound with
 * port 0, so a running dilocod that holds the real port (a reload, an ExecStartPre) does not fail
 * the check; a port that is busy or privileged is still only found out by the start. */
static int check_listen(const config *c)
{
    struct addrinfo hints = {0}, *res = NULL;
    int rc, fd, e;

    if (c->listen_host == NULL)
        return 0;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    if ((rc = getaddrinfo(c->listen_host, "0", &hints, &res)) != 0)
        return config__bad_opt(c, "listen", "'%s': cannot resolve the host: %s", c->listen,
                       rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc));
    fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    e = fd < 0 ? errno : (bind(fd, res->ai_addr, res->ai_addrlen) != 0 ? errno : 0);
    if (fd >= 0)
        close(fd);
    freeaddrinfo(res);
    if (e == EADDRNOTAVAIL)
        return config__bad_opt(c, "listen", "'%s': %s is not an address of this machine", c->listen, c->listen_host);
    if (e != 0)
        return config__bad_opt(c, "listen", "'%s': cannot bind: %s", c->listen, strerror(e));
    return 0;
}

/* Loaded as the start loads it (short tokens, bad node ids, an empty file are refused), then dropped:
 * the daemon loads its own table. */
static int check_token_file(const config *c)
{
    auth_table t = {0};
    dl_error err;
    int rc;

    if (c->token_file == NULL)
        return 0;
    if ((rc = check_regular_file(c, "token_file", c->token_file)) != 0)
        return rc;
    dl_error_clear(&err);
    if (auth_load(&t, c->token_file, &err) != 0)
        return config__bad_opt(c, "token_file", "%s", err.message);
    auth_free(&t);
    return 0;
}

/* Loaded as the start loads it (an Ed25519 PKCS#8 key no one else can read), then dropped. */
static int check_signing_key(const config *c)
{
    sign_key k;
    dl_error err;
    int rc;

    if (c->signing_key == NULL)
        return 0;
    if ((rc = check_regular_file(c, "signing_key", c->signing_key)) != 0)
        return rc;
    dl_error_clear(&err);
    if (sign_key_load(&k, c->signing_key, &err) != 0)
        return config__bad_opt(c, "signing_key", "%s", err.message);
    sign_key_free(&k);
    return 0;
}

/* The start creates the directories below path: every part of it that exists must be a directory.
 * Writability is left to the start, which may run as another user (systemd's DynamicUser). */
static int check_dir_path(const config *c, const char *key, const char *path)
{
    dl_error err;

    dl_error_clear(&err);
    return fsu_check_dir_path(path, &err) != 0 ? config__bad_opt(c, key, "%s", err.message) : 0;
}

int config__state_committed(const config *c)
{
    char *dir = store_path_state_dir(c->state_root, c->id);
    char *meta = dir != NULL ? store_path_metadata(dir) : NULL;
    int committed;

    free(dir);
    if (meta == NULL)
        return -1;
    committed = access(meta, F_OK) == 0;
    free(meta);
    return committed;
}

/* Startup uses the init model only when <state_root>/<id> holds no committed step: then it must be a
 * safetensors file or a sharded checkpoint's index, read as the bootstrap reads it (headers parsed,
 * sizes and the set checked; data not read). */
static int check_init_model(const config *c)
{
    st_set *f = NULL;
    dl_error err;
    int rc, committed;

    if (c->init_model == NULL)
        return 0;
    if ((committed = config__state_committed(c)) < 0)
        return config__bad("", "init_model", "out of memory");
    if (committed)
        return 0;
    if ((rc = check_regular_file(c, "init_model", c->init_model)) != 0)
        return rc;
    dl_error_clear(&err);
    /* one file, or the index of a sharded checkpoint (its shards checked as a set) */
    if (st_set_open(c->init_model, &f, &err) != 0)
        return config__bad_opt(c, "init_model", "%s is not a usable safetensors file or index: %s: %s", c->init_model,
                       dl_error_name(err.code), err.message);
    st_set_close(f);
    return 0;
}

int config__validate(config *c)
{
    int rc;

    if (c->origin == NULL || c->hub_opts == NULL || c->state_root == NULL || c->id == NULL || c->hub == NULL)
        return config__bad("", "config", "out of memory");
    if (c->state_root[0] == '\0')
        return config__bad_opt(c, "state_root", "must not be empty");
    if (!delta_valid_node_id(c->id, strlen(c->id)))
        return config__bad_opt(c, "id", "'%s' is not a valid id ([A-Za-z0-9._-]{1,64}, not . or ..)", c->id);
    /* the scheme table (hub.c) knows the transports and checks each URL */
    dl_error herr;
    if (hub_check_url(c->hub, &herr) != 0)
        return config__bad_opt(c, "hub", "%s", herr.message);
    if ((rc = load_transport_options(c)) != 0)
        return rc;
    if (c->nnodes > 0) {
        if (c->expected_nodes != 0 && c->expected_nodes != c->nnodes)
            return config__bad_opt(c, "expected_nodes", "%u disagrees with the %zu ids given by --nodes", c->expected_nodes,
                       c->nnodes);
        c->expected_nodes = (unsigned)c->nnodes;
    }
    if (c->async) {
        /* an update closes by its grace window: round_timeout and min_nodes do not apply */
        if (c->dn_period == 0)
            c->dn_period = c->expected_nodes ? c->expected_nodes : 1;
        if (c->async_queue == 0)
            c->async_queue = c->expected_nodes * 4 > 16 ? c->expected_nodes * 4 : 16;
        if (c->dn_c > 1.0 / c->dn_period)
            return config__bad_opt(c, "dn_momentum_activation", "%g is above 1/N = 1/%u (dn_period)", c->dn_c, c->dn_period);
    }
    if (c->max_norm_ratio != 0 && c->max_norm_ratio < 1)
        return config__bad_opt(c, "max_norm_ratio", "%g would quarantine deltas below the median: give 0 (off) or R >= 1",
                       c->max_norm_ratio);
    if (c->aggregate == RULE_TRIMMED && c->expected_nodes != 0 && 2 * c->trim_k >= c->expected_nodes)
        return config__bad_opt(c, "aggregate", "trimmed_mean:%u trims every value of a round of %u nodes (2K must be below it)",
                       c->trim_k, c->expected_nodes);
    if (c->publish_interval < 0)
        c->publish_interval = c->async && strncmp(c->hub, "hf://", 5) == 0 ? 30 : 0;
    if (c->verify_keep != -1 && (c->verify_keep < 0 || c->verify_keep != (double)(unsigned)c->verify_keep))
        return config__bad_opt(c, "verify_keep", "%g is not a number of steps (0 to 100000, or -1 for the default)",
                               c->verify_keep);
    if (c->verify_keep < 0)
        c->verify_keep = c->signing_key != NULL ? 16 : 0;
    /* what combines (config_modes.c: the table README's "What combines" is checked against) */
    if ((rc = config__check_combinations(c)) != 0)
        return rc;
    if (c->expected_nodes != 0 && c->min_nodes > c->expected_nodes)
        return config__bad_opt(c, "min_nodes", "%u is more than the %u expected nodes", c->min_nodes, c->expected_nodes);
    if (c->momentum < 0)
        c->momentum = c->optimizer == OPT_NESTEROV_SGD ? 0.9 : 0.0;
    if (c->momentum >= 1)
        return config__bad_opt(c, "momentum", "%g must be below 1", c->momentum);
    if (c->listen == NULL)
        return config__bad("", "config", "out of memory");
    if ((rc = parse_listen(c)) != 0 || (rc = check_listen(c)) != 0 || (rc = check_token_file(c)) != 0 ||
        (rc = check_signing_key(c)) != 0)
        return rc;
    if ((rc = check_dir_path(c, "state_root", c->state_root)) != 0)
        return rc;
    /* last: the most expensive check, and the one a test of any other option should not trip over */
    return check_init_model(c);
}
