/* dilocod: the DiLoCo outer-loop aggregator. */
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "daemon.h"

/* A peer that hangs up while we write must cost its connection, not the process: sendfile(2) and
 * writev(2) have no MSG_NOSIGNAL, so SIGPIPE is ignored process-wide and writes fail with EPIPE. */
static int ignore_sigpipe(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = SIG_IGN;
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGPIPE, &sa, NULL);
}

int main(int argc, char **argv)
{
    config cfg;
    int rc;

    /* Buffers of 256 KiB and more (an upload's two 1 MiB buffers, aggregation buffers) are mapped
     * and unmapped on their own.  glibc's default raises this threshold to the size of the largest
     * block freed, after which such buffers come from the heap, whose freed pages stay resident:
     * under churn (uploads that start and fail) the RSS of a long-running daemon crept upwards. */
    mallopt(M_MMAP_THRESHOLD, 256 * 1024);
    if (ignore_sigpipe() != 0) {
        perror("dilocod: cannot ignore SIGPIPE");
        return 1;
    }
    rc = config_load(&cfg, argc, argv);

    if (rc != 0) {
        config_free(&cfg);
        return rc == 1 ? 0 : 2;
    }
    dl_log_set_level(cfg.log_level);
    dl_log_set_json(cfg.log_json);
    rc = daemon_run(&cfg);
    config_free(&cfg);
    return rc;
}
