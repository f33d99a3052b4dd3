/* dilocod: the DiLoCo outer-loop aggregator. */
#include <stdio.h>
#include <stdlib.h>

#include "config.h"
#include "daemon.h"

int main(int argc, char **argv)
{
    config cfg;
    int rc = config_load(&cfg, argc, argv);

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
