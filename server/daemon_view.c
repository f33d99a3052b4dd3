/* What the rest of server/ reads of the daemon (daemon.h): one accessor per fact the routes and the
 * uploads need, so that api/ never sees struct dilocod and a change of the daemon's state (its
 * lifecycle, say) changes these and nothing in api/. */
#include "daemon.h"
#include "daemon_internal.h"
#include "s3_cluster.h"
#include "daemon_parts.h"

const config *daemon_config(const dilocod *d)
{
    return d->cfg;
}

uv_loop_t *daemon_loop(dilocod *d)
{
    return &d->loop;
}

const store *daemon_store(const dilocod *d)
{
    return &d->st;
}

time_t daemon_committed_at(const dilocod *d)
{
    return d->committed_at;
}

const round_state *daemon_round(const dilocod *d)
{
    return &d->rnd;
}

const history *daemon_history(const dilocod *d)
{
    return &d->history;
}

const st_header *daemon_model(const dilocod *d)
{
    return d->model;
}

uint64_t daemon_delta_bytes(const dilocod *d)
{
    return d->delta_bytes;
}

int daemon_takes_uploads(const dilocod *d)
{
    return daemon__state(d) != S_WAITING_GLOBAL && d->model != NULL;
}

const char *daemon_state_name(const dilocod *d)
{
    int64_t step;
    if (d->cluster != NULL)
        return cluster_state(d->cluster, &step);
    return daemon__state_name(daemon__state(d));
}

int daemon_stopping(const dilocod *d)
{
    return d->stopping;
}

stats *daemon_stats(dilocod *d)
{
    return &d->m;
}

dilocod *daemon_of_job(const pool_job *j)
{
    return daemon__of_job(j);
}

int daemon_quarantine_detail(const dilocod *d, const char *node_id, double *norm, double *bound, const char **reason,
                             const char **basis)
{
    const robust_event *e = daemon__robust_last(d, node_id);
    if (e == NULL)
        return -1;
    *norm = e->norm;
    *bound = e->bound;
    *reason = e->reason;
    *basis = e->basis;
    return 0;
}
