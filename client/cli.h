/* Shared pieces of the diloco command-line tool. */
#ifndef CLI_H
#define CLI_H

#include <cJSON.h>

#include "dl_error.h"

/* Exit codes, documented in the README. */
enum {
    EXIT_OK = 0,
    EXIT_INVALID = 1,   /* the input is invalid (a rejected file or delta) */
    EXIT_USAGE = 2,     /* bad command line */
    EXIT_IO = 3,        /* I/O or system error */
    EXIT_NETWORK = 4,   /* the server could not be reached or kept failing (after retries) */
    EXIT_TIMEOUT = 5,   /* diloco wait: the step was not reached in time */
};

/* Prints "diloco: <what>: <code>: <message> (tensor <t>)" to stderr and returns the exit code that
 * fits the error. */
int cli_report(const char *what, const dl_error *err);
/* Exit code for an error code. */
int cli_exit_code(dl_code code);
/* {"code","message","tensor"?} for err (NULL on allocation failure). */
cJSON *cli_error_object(const dl_error *err);
/* Prints root compactly on one line to stdout and frees it. */
void cli_print_json(cJSON *root);
/* Prints {"error":{...}} for err to stdout. */
void cli_print_error_json(const dl_error *err);

int cmd_inspect(int argc, char **argv);
int cmd_verify(int argc, char **argv);
int cmd_delta(int argc, char **argv);
int cmd_average(int argc, char **argv);
int cmd_hash(int argc, char **argv);
int cmd_push(int argc, char **argv);
int cmd_pull(int argc, char **argv);
int cmd_status(int argc, char **argv);
int cmd_wait(int argc, char **argv);
int cmd_keygen(int argc, char **argv);
int cmd_verify_round(int argc, char **argv);

#endif
