/* Minimal unit-test harness: TEST() registers a function; the runner forks one child per test so a
 * crash or a leak report fails only that test, and prints "N passed, N failed". */
#ifndef TEST_H
#define TEST_H

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

typedef void (*test_fn)(void);
void test_register(const char *name, const char *file, test_fn fn);
void test_fail(void);
/* A fresh, empty directory for the running test (removed afterwards). */
const char *test_dir(void);
/* test_dir()/name in a static buffer (one at a time per call site: copy if you need several). */
const char *test_path(const char *name);

#define TEST(name)                                                                                    \
    static void name(void);                                                                           \
    __attribute__((constructor)) static void register_##name(void) { test_register(#name, __FILE__, name); } \
    static void name(void)

#define CHECK(cond)                                                                                   \
    do {                                                                                              \
        if (!(cond)) {                                                                                \
            fprintf(stderr, "  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);               \
            test_fail();                                                                              \
            return;                                                                                   \
        }                                                                                             \
    } while (0)

#define CHECK_INT(a, op, b)                                                                           \
    do {                                                                                              \
        long long va_ = (long long)(a), vb_ = (long long)(b);                                         \
        if (!(va_ op vb_)) {                                                                          \
            fprintf(stderr, "  %s:%d: CHECK(%s %s %s) failed: %lld vs %lld\n", __FILE__, __LINE__, #a, #op, #b, \
                    va_, vb_);                                                                        \
            test_fail();                                                                              \
            return;                                                                                   \
        }                                                                                             \
    } while (0)

#define CHECK_EQ(a, b) CHECK_INT(a, ==, b)

#define CHECK_HEX(a, b)                                                                               \
    do {                                                                                              \
        unsigned long long va_ = (unsigned long long)(a), vb_ = (unsigned long long)(b);              \
        if (va_ != vb_) {                                                                             \
            fprintf(stderr, "  %s:%d: CHECK(%s == %s) failed: 0x%llx vs 0x%llx\n", __FILE__, __LINE__, #a, #b, \
                    va_, vb_);                                                                        \
            test_fail();                                                                              \
            return;                                                                                   \
        }                                                                                             \
    } while (0)

#define CHECK_STR(a, b)                                                                               \
    do {                                                                                              \
        const char *va_ = (a), *vb_ = (b);                                                            \
        if (va_ == NULL || vb_ == NULL || strcmp(va_, vb_) != 0) {                                    \
            fprintf(stderr, "  %s:%d: CHECK(%s == %s) failed: \"%s\" vs \"%s\"\n", __FILE__, __LINE__, #a, #b, \
                    va_ ? va_ : "(null)", vb_ ? vb_ : "(null)");                                      \
            test_fail();                                                                              \
            return;                                                                                   \
        }                                                                                             \
    } while (0)

#define CHECK_MEM(a, b, n)                                                                            \
    do {                                                                                              \
        if (memcmp((a), (b), (n)) != 0) {                                                             \
            fprintf(stderr, "  %s:%d: CHECK_MEM(%s, %s, %zu) failed:\n    %.*s\n    %.*s\n", __FILE__, __LINE__, \
                    #a, #b, (size_t)(n), (int)(n), (const char *)(a), (int)(n), (const char *)(b));   \
            test_fail();                                                                              \
            return;                                                                                   \
        }                                                                                             \
    } while (0)

#endif
