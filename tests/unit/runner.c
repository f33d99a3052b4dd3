#include "test.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_TESTS 1024

struct test_entry {
    const char *name, *file;
    test_fn fn;
};

static struct test_entry tests[MAX_TESTS];
static int ntests;
static int failed_flag;
static char dir[256];

void test_register(const char *name, const char *file, test_fn fn)
{
    if (ntests < MAX_TESTS)
        tests[ntests++] = (struct test_entry){name, file, fn};
}

void test_fail(void)
{
    failed_flag = 1;
}

const char *test_dir(void)
{
    return dir;
}

const char *test_path(const char *name)
{
    static char buf[512];
    snprintf(buf, sizeof(buf), "%s/%s", dir, name);
    return buf;
}

static void remove_dir(void)
{
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "warning: could not remove %s\n", dir);
}

/* Usage: unit-tests [substring]  runs the tests whose name contains substring. */
int main(int argc, char **argv)
{
    int passed = 0, failed = 0;

    for (int i = 0; i < ntests; i++) {
        pid_t pid;
        int status;

        if (argc > 1 && strstr(tests[i].name, argv[1]) == NULL)
            continue;
        snprintf(dir, sizeof(dir), "/tmp/diloco-unit-XXXXXX");
        if (mkdtemp(dir) == NULL) {
            perror("mkdtemp");
            return 1;
        }
        fflush(NULL);
        pid = fork();
        if (pid == 0) {
            failed_flag = 0;
            tests[i].fn();
            fflush(NULL);
            exit(failed_flag ? 1 : 0);     /* exit, not _exit: LeakSanitizer reports at exit */
        }
        if (pid < 0 || waitpid(pid, &status, 0) < 0) {
            perror("fork/wait");
            return 1;
        }
        remove_dir();
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
            passed++;
        } else {
            failed++;
            if (WIFSIGNALED(status))
                fprintf(stderr, "FAIL %s (%s): killed by signal %d\n", tests[i].name, tests[i].file,
                        WTERMSIG(status));
            else
                fprintf(stderr, "FAIL %s (%s)\n", tests[i].name, tests[i].file);
        }
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
