// What DBeaver and BI tools do through the Arrow Flight SQL JDBC driver: list catalogs and
// tables, run a query, run a prepared statement with a parameter. Run by
// tests/test_flight_sql.py: java FlightSqlJdbc URL QUERY PARAMETERIZED_QUERY; prints lines
// "catalog ...", "table ...", "row\t...", "param\t..." for the test to check.
import java.sql.Connection;
import java.sql.DatabaseMetaData;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.Statement;

public class FlightSqlJdbc {
  private static void print(String tag, ResultSet r) throws Exception {
    int n = r.getMetaData().getColumnCount();
    while (r.next()) {
      StringBuilder b = new StringBuilder(tag);
      for (int i = 1; i <= n; i++) {
        b.append('\t').append(r.getString(i));
      }
      System.out.println(b);
    }
  }

  public static void main(String[] args) throws Exception {
    try (Connection c = DriverManager.getConnection(args[0])) {
      DatabaseMetaData md = c.getMetaData();
      System.out.println("product\t" + md.getDatabaseProductName());
      try (ResultSet r = md.getCatalogs()) {
        print("catalog", r);
      }
      try (ResultSet r = md.getTables(null, null, "%", null)) {
        while (r.next()) {
          System.out.println("table\t" + r.getString("TABLE_NAME"));
        }
      }
      try (Statement s = c.createStatement(); ResultSet r = s.executeQuery(args[1])) {
        print("row", r);
      }
      try (PreparedStatement p = c.prepareStatement(args[2])) {
        p.setLong(1, 2L);
        try (ResultSet r = p.executeQuery()) {
          print("param", r);
        }
      }
    }
  }
}
