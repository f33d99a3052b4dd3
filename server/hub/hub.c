/* hub: the scheme table and what every transport shares (hub.h). */
#include "hub.h"

#include <stdio.h>
#include <string.h>

extern const hub_ops hub_file_ops;
extern const hub_ops hub_hf_ops;
extern const hub_ops hub_s3_ops;

/* One row per transport: adding one is a new hub_<scheme>.c (its hub_ops and its option table) and a
 * row here.  The order is --help's and --check-config's for the transports' options. */
static const hub_ops *const transports[] = {
    &hub_file_ops,
    &hub_hf_ops,
    &hub_s3_ops,
};

const hub_ops *hub_find(const char *url)
{
    for (size_t i = 0; i < sizeof(transports) / sizeof(transports[0]); i++)
        if (strncmp(url, transports[i]->scheme, strlen(transports[i]->scheme)) == 0)
            return transports[i];
    return NULL;
}

size_t hub_transport_count(void)
{
    return sizeof(transports) / sizeof(transports[0]);
}

const hub_ops *hub_transport(size_t i)
{
    return i < hub_transport_count() ? transports[i] : NULL;
}

int hub_check_url(const char *url, dl_error *err)
{
    const hub_ops *ops;

    if (strcmp(url, "none") == 0)
        return 0;
    if ((ops = hub_find(url)) == NULL) {
        char schemes[128] = "";
        for (size_t i = 0; i < sizeof(transports) / sizeof(transports[0]); i++) {
            size_t n = strlen(schemes);
            snprintf(schemes + n, sizeof(schemes) - n, "%s%s...", i ? ", " : "", transports[i]->scheme);
        }
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "unknown hub \"%.200s\": expected none, %s", url,
                       schemes);
    }
    return ops->check_url(url, err);
}

int hub_open(hub **out, uv_loop_t *loop, const hub_config *cfg, const hub_callbacks *cb, void *app, dl_error *err)
{
    const hub_ops *ops = hub_find(cfg->url);

    *out = NULL;
    if (ops == NULL)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "unknown hub \"%.200s\"", cfg->url);
    return ops->open(out, loop, cfg, cb, app, err);
}

void hub_count_call(hub_status *st, const char *route, int code)
{
    unsigned i;

    for (i = 0; i < st->ncalls; i++)
        if (st->calls[i].code == code && strcmp(st->calls[i].route, route) == 0)
            break;
    if (i == st->ncalls) {
        if (st->ncalls == HUB_MAX_CALL_ROWS) {
            i = HUB_MAX_CALL_ROWS - 1;  /* full: the last row absorbs the rest (never seen in practice) */
        } else {
            st->calls[i].route = route;
            st->calls[i].code = code;
            st->ncalls++;
        }
    }
    st->calls[i].count++;
}

int hub_is_http_url(const char *s)
{
    return strncmp(s, "https://", 8) == 0 || strncmp(s, "http://", 7) == 0;
}
