/* diloco keygen: the Ed25519 keys of verifiable rounds (common/sign.h). */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "sign.h"

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
