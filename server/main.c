/* dilocod: the DiLoCo outer-loop aggregator. */
#include <errno.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "config.h"
#include "api.h"
#include "daemon.h"
#include "dl_log.h"

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

/* The soft RLIMIT_NOFILE up to the hard one: connections, downloads and a pass's shards all take
 * descriptors, and a soft limit of 1024 (the usual default) is a cap nothing needs.  Logged either way:
 * the limit a daemon ran with says what EMFILE it could meet. */
static void raise_nofile(void)
{
    struct rlimit rl;
    rlim_t was;

    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
        dl_log(DL_LOG_WARN, "main", "cannot read RLIMIT_NOFILE", "errno=%d", errno);
        return;
    }
    was = rl.rlim_cur;
    if (rl.rlim_cur != rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
            dl_log(DL_LOG_WARN, "main", "cannot raise RLIMIT_NOFILE", "soft=%llu hard=%llu errno=%d",
                   (unsigned long long)was, (unsigned long long)rl.rlim_max, errno);
            return;
        }
    }
    dl_log(DL_LOG_INFO, "main", "descriptors", "nofile_soft_was=%llu nofile=%llu", (unsigned long long)was,
           (unsigned long long)rl.rlim_cur);
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
    raise_nofile();
    rc = daemon_run(&cfg, &api_front);
    config_free(&cfg);
    return rc;
}
