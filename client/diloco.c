/* diloco: the client tool of dilocod. */
#include <stdio.h>
#include <string.h>

#include <cJSON.h>
#include <curl/curl.h>

#include "cli.h"
#include "cli_untrusted.h"

#ifndef DILOCO_VERSION
#define DILOCO_VERSION "0.1.0"
#endif

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *summary;
} commands[] = {
    {"inspect", cmd_inspect, "show a safetensors file's header, metadata and tensors"},
    {"verify", cmd_verify, "check a delta file strictly (optionally against a global model and a path)"},
    {"delta", cmd_delta, "write the pseudo-gradient (baseline - current) of two model files"},
    {"average", cmd_average, "FP32 average of delta files (a debugging aid)"},
    {"hash", cmd_hash, "print files' block hash (sha256 over their 16 MiB blocks' sha256)"},
    {"push", cmd_push, "upload a delta to dilocod (node id and step from its metadata)"},
    {"pull", cmd_pull, "download the global model and its step file when they changed"},
    {"status", cmd_status, "show dilocod's round and the last rounds"},
    {"wait", cmd_wait, "block until dilocod reaches an outer step"},
    {"verify-round", cmd_verify_round, "check a signed step's record and recompute the step from its inputs"},
    {"keygen", cmd_keygen, "write an Ed25519 signing key pair for --signing-key (or print a key's fingerprint)"},
};

static void usage(FILE *out)
{
    fprintf(out, "usage: diloco <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        fprintf(out, "  %-12s %s\n", commands[i].name, commands[i].summary);
    fprintf(out, "\n'diloco <command> --help' describes a command.\n"
                 "exit codes: 0 ok, 1 invalid input or refused by the server, 2 usage error, 3 I/O error,\n"
                 "            4 network or server error (after retries), 5 timeout (wait)\n");
}

int cli_exit_code(dl_code code)
{
    switch (code) {
    case DL_E_IO:
    case DL_E_NO_MEMORY:
        return EXIT_IO;
    case DL_E_INVALID_ARGUMENT:
        return EXIT_USAGE;
    default:
        return EXIT_INVALID;
    }
}

/* The message and the tensor name can quote a file's or a server's bytes: printed in their shown form. */
int cli_report(const char *what, const dl_error *err)
{
    /* a shown form is at most 6 bytes for each byte of a field (cli_untrusted.h): nothing is cut */
    char message[6 * sizeof(err->message)], tensor[6 * sizeof(err->tensor)];

    cli_untrusted(message, sizeof(message), err->message, strnlen(err->message, sizeof(err->message)));
    cli_untrusted(tensor, sizeof(tensor), err->tensor, strnlen(err->tensor, sizeof(err->tensor)));
    if (tensor[0] != '\0')
        fprintf(stderr, "diloco: %s: %s: %s (tensor \"%s\")\n", what, dl_error_name(err->code), message, tensor);
    else
        fprintf(stderr, "diloco: %s: %s: %s\n", what, dl_error_name(err->code), message);
    return cli_exit_code(err->code);
}

cJSON *cli_error_object(const dl_error *err)
{
    cJSON *e = cJSON_CreateObject();

    if (e == NULL || !cJSON_AddStringToObject(e, "code", dl_error_name(err->code)) ||
        !cJSON_AddStringToObject(e, "message", err->message) ||
        (err->tensor[0] != '\0' && !cJSON_AddStringToObject(e, "tensor", err->tensor))) {
        cJSON_Delete(e);
        return NULL;
    }
    return e;
}

/* In its shown form: cJSON escapes C0 in strings, not DEL, C1 or bytes that are not UTF-8 (a file's
 * names and metadata, a server's messages can hold them). */
void cli_print_json(cJSON *root)
{
    char *text = root ? cJSON_PrintUnformatted(root) : NULL;

    if (text != NULL) {
        cli_print_untrusted(stdout, text, strlen(text));
        putchar('\n');
    } else
        fprintf(stderr, "diloco: out of memory printing JSON\n");
    cJSON_free(text);
    cJSON_Delete(root);
}

void cli_print_error_json(const dl_error *err)
{
    cJSON *root = cJSON_CreateObject(), *e = cli_error_object(err);

    if (root == NULL || e == NULL || !cJSON_AddItemToObject(root, "error", e)) {
        cJSON_Delete(e);
        cJSON_Delete(root);
        root = NULL;
    }
    cli_print_json(root);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return EXIT_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("diloco %s\n", DILOCO_VERSION);
        return EXIT_OK;
    }
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
        if (strcmp(argv[1], commands[i].name) == 0) {
            if (curl_global_init(CURL_GLOBAL_DEFAULT) != 0) {
                fprintf(stderr, "diloco: cannot initialise libcurl\n");
                return EXIT_IO;
            }
            int rc = commands[i].fn(argc - 1, argv + 1);
            curl_global_cleanup();
            return rc;
        }
    }
    fprintf(stderr, "diloco: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return EXIT_USAGE;
}
